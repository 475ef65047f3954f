"""The Megatron-core trainer: model building from HF configs, HF <-> Megatron conversion, the
training step, checkpoints and HF export. ``MegatronTrainer`` (trainer.py) is the entry point;
heavy imports (torch, megatron) happen inside the submodules, not here."""
