"""Packed micro-batches keep their segment offsets on the host, whatever the model's device,
and a device copy for the varlen attention kernel.

Megatron's THD RoPE reads ``cu_seqlens`` as Python ints twice per layer; on a GPU each read of
a device tensor is a sync. The "meta" device stands in for CUDA.
"""

from __future__ import annotations

import torch

from vime_core.trainer.packing import pack_samples


def test_offsets_stay_on_the_host_when_the_inputs_go_to_the_device():
    packed = pack_samples([[5, 6, 7, 8], [9, 10, 11]], [2, 1], device="meta")
    assert packed.input_ids.device.type == "meta"
    assert packed.targets.device.type == "meta"
    assert packed.cu_seqlens.device.type == "cpu"
    assert packed.cu_seqlens.tolist() == [0, 4, 7]
    params = packed.packed_seq_params()
    assert params.cu_seqlens_q.device.type == "cpu" and params.cu_seqlens_kv.device.type == "cpu"
    # the varlen kernel's copy: int32 on the device, handed over with Megatron's parameters
    assert packed.cu_seqlens_device.device.type == "meta" and packed.cu_seqlens_device.dtype == torch.int32
    assert params.cu_seqlens_device is packed.cu_seqlens_device


def test_cpu_packing_keeps_one_offsets_tensor():
    packed = pack_samples([[5, 6, 7], [8, 9]], [1, 1])
    assert packed.cu_seqlens_device.tolist() == [0, 3, 5]
    assert packed.cu_seqlens_device.dtype == packed.cu_seqlens.dtype
