#!/usr/bin/env bash
# The vLLM environment's interpreter on a GPU host without network, prepared with
# the host's bundle of pinned wheels (vLLM 0.26.0 unpacked in /tmp/site-vllm, ray & co. in
# /tmp/site-trainer): the host's python3 with vLLM's site first. Pass it as --vllm-python.
# vLLM's `ipc` weight-transfer engine imports ray, hence site-trainer after site-vllm.
export PYTHONPATH="${VIME_SITE_VLLM:-/tmp/site-vllm}:${VIME_SITE_TRAINER:-/tmp/site-trainer}${PYTHONPATH:+:$PYTHONPATH}"
# as vLLM was served on the host for bench/results
export VLLM_USE_FLASHINFER_SAMPLER="${VLLM_USE_FLASHINFER_SAMPLER:-0}"
exec "${VIME_HOST_PYTHON:-python3}" "$@"
