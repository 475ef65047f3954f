"""Fixtures of the trainer tests: tiny checkpoints of every family, and a single-rank process
group (gloo over loopback on a free port) shared by the in-process tests."""

from __future__ import annotations

from pathlib import Path

import pytest

# (family, tie_word_embeddings): every family tied, plus one untied; kv heads 2 so TP=2 works.
FAMILY_CASES = [("qwen3", True), ("qwen2", True), ("llama", True), ("qwen3", False), ("llama", False)]


def tiny_checkpoint(cache_dir: Path, family: str, tie: bool, **shape) -> Path:
    from vime_core.demo.model import build_tiny_model

    name = f"trainer-{family}-{'tied' if tie else 'untied'}"
    return build_tiny_model(
        cache_dir / "models" / name,
        family=family,
        seed=1,
        tie_word_embeddings=tie,
        num_heads=4,
        num_kv_heads=2,
        **shape,
    )


@pytest.fixture(scope="session")
def single_rank():
    """torch.distributed (gloo, world 1) + Megatron parallel state at TP=1 for this process."""
    from vime_core.trainer.parallel import destroy_parallel, free_port, init_parallel

    layout = init_parallel(0, 1, "127.0.0.1", free_port(), tp_size=1)
    yield layout
    destroy_parallel()
