"""The Megatron-core trainer: model building from HF configs, HF <-> Megatron conversion, the
training step, checkpoints and HF export. ``MegatronTrainer`` (trainer.py) is the entry point;
heavy imports (torch, megatron) happen inside the submodules, not here."""

from vime_core.utils.quiet import quiet_library_warnings

# Before any submodule imports Megatron, whose import-time fallback warnings are the noise.
quiet_library_warnings()
