"""THD packing: offsets, positions, and which logits predict which response tokens."""

from __future__ import annotations

import pytest
import torch

from vime_core.trainer.packing import pack_samples


def test_pack_offsets_positions_and_targets():
    tokens = [[5, 6, 7, 8], [9, 10, 11], [12, 13]]
    responses = [2, 1, 1]
    packed = pack_samples(tokens, responses)
    assert packed.input_ids.tolist() == [[5, 6, 7, 8, 9, 10, 11, 12, 13]]
    assert packed.cu_seqlens.tolist() == [0, 4, 7, 9]
    assert packed.position_ids.tolist() == [[0, 1, 2, 3, 0, 1, 2, 0, 1]]
    assert packed.max_seqlen == 4
    # every response token, in order, with the position whose logits predict it
    expected_targets = [t for seq, r in zip(tokens, responses) for t in seq[len(seq) - r :]]
    assert packed.targets.tolist() == expected_targets
    flat = packed.input_ids[0]
    assert torch.equal(flat[packed.logit_index + 1], packed.targets)
    assert packed.num_tokens == sum(map(len, tokens))  # no padding at all


@pytest.mark.parametrize(
    "tokens,responses,match",
    [
        ([], [], "empty"),
        ([[1, 2]], [2], "response_length=2"),
        ([[1, 2]], [0], "response_length=0"),
        ([[1, 2]], [1, 1], "2 response_lengths"),
    ],
)
def test_bad_micro_batches_are_refused(tokens, responses, match):
    with pytest.raises(ValueError, match=match):
        pack_samples(tokens, responses)
