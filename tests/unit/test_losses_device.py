"""The loss helpers build their index tensors on the device of their inputs (GPU training).

Checked on PyTorch's "meta" device, which mixes with CPU tensors no better than CUDA does, so a
helper that creates a CPU tensor internally fails here just as it fails on a GPU.
"""

from __future__ import annotations

import torch

from vime_core.algo.losses import aggregate_loss, sequence_mean_kl


def test_sequence_mean_kl_stays_on_the_input_device():
    lengths = [3, 2]
    kl = torch.randn(sum(lengths)).to("meta")
    mask = torch.ones(sum(lengths)).to("meta")
    out = sequence_mean_kl(kl, mask, lengths)
    assert out.device.type == "meta"
    assert out.shape == (sum(lengths),)


def test_seq_mean_token_sum_aggregation_stays_on_the_input_device():
    lengths = [4, 1, 2]
    per_token = torch.randn(sum(lengths)).to("meta")
    mask = torch.ones(sum(lengths)).to("meta")
    out = aggregate_loss(per_token, mask, "seq_mean_token_sum", lengths)
    assert out.device.type == "meta"


def test_seq_mean_token_mean_aggregation_stays_on_the_input_device():
    lengths = [4, 1, 2]
    per_token = torch.randn(sum(lengths)).to("meta")
    out = aggregate_loss(per_token, torch.ones(sum(lengths)).to("meta"), "seq_mean_token_mean", lengths)
    assert out.device.type == "meta" and out.shape == ()


def test_sequence_sums_on_cpu_unchanged():
    lengths = [3, 2]
    kl = torch.tensor([1.0, 2.0, 3.0, 10.0, 20.0])
    mask = torch.tensor([1.0, 1.0, 0.0, 1.0, 1.0])
    expected = torch.tensor([1.5, 1.5, 1.5, 15.0, 15.0])  # masked means per sequence, broadcast
    torch.testing.assert_close(sequence_mean_kl(kl, mask, lengths), expected)
