"""The engine end of weight sync: code that runs *inside* the vLLM server process (loaded
through `--worker-extension-cls`), the receivers, and the engine's authentication (`--middleware`).

    worker_ext.py         the worker extension: registers the backends, answers the trainer's
                          `/collective_rpc` calls (weight spec, GPU, broadcast group, version)
    shm_backend.py        backend `vime_shm`: buckets from shared-memory files
    broadcast_backend.py  backend `vime_broadcast`: buckets broadcast over NCCL or gloo
    reload_session.py     the weight-update session both backends share (layerwise reload)
    auth.py               the ASGI middleware that asks every request for the run's token

Everything here imports only vllm, torch, the standard library and the wire formats it shares
with the trainer (`vime_core.wire`): the vLLM environment has neither the trainer's
packages nor Prefect (tests/unit/test_weight_sync_layout.py checks it). The sending end is
`vime_core/weight_sync/`.
"""
