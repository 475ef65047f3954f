"""Resolving a configuration for the actors of a run: absolute paths (actors do not share the
driver's working directory), a hub id in ``hf_checkpoint`` (and ``opd_teacher_load``) replaced
by its local snapshot folder (vime_core/models/hub.py), and the embedded default model and task
data when the configuration names none (the default job on a fresh machine)."""

from __future__ import annotations

import logging
import os
from pathlib import Path

from vime_core.config import VimeConfig
from vime_core.data.sources import check_source, resolve_local

log = logging.getLogger(__name__)

REPO = Path(__file__).resolve().parents[1]


def _is_remote(uri: str) -> bool:
    return "://" in uri and not uri.startswith("file://")


def _abs(path: str, base: Path) -> str:
    if not path or _is_remote(path):
        return path
    p = Path(path.removeprefix("file://")).expanduser()
    # abspath, not resolve(): a venv's bin/python is a symlink whose target is not the venv
    return os.path.abspath(p if p.is_absolute() else base / p)


def _checkpoint_folder(value: str, base: Path, field: str = "hf_checkpoint") -> str:
    if not value or _is_remote(value):
        return value
    from vime_core.models.hub import resolve_hf_checkpoint

    return resolve_hf_checkpoint(value, base, field)


def assets_dir(cfg: VimeConfig) -> Path:
    """Local folder for built models and generated data: beside local storage, else in .cache."""
    root = Path(cfg.storage_uri) if not _is_remote(cfg.storage_uri) else REPO / ".cache"
    return root / "_assets"


def resolve_run_config(cfg: VimeConfig, base: Path | None = None) -> VimeConfig:
    base = base or Path.cwd()
    updates = {
        "storage_uri": _abs(cfg.storage_uri, base),
        "hf_checkpoint": _checkpoint_folder(cfg.hf_checkpoint, base),
        "opd_teacher_load": _checkpoint_folder(cfg.opd_teacher_load, base, "opd_teacher_load")
        if cfg.opd_teacher_load
        else None,
        "prompt_data": resolve_local(cfg.prompt_data, base),
        "eval_prompt_data": resolve_local(cfg.eval_prompt_data, base),
        "vllm_python": _abs(cfg.vllm_python, REPO) if not Path(cfg.vllm_python).is_absolute() else cfg.vllm_python,
    }
    resolved = cfg.model_copy(update=updates)
    assets = assets_dir(resolved)
    if not resolved.hf_checkpoint:
        from vime_core.demo.model import build_tiny_model

        path = build_tiny_model(assets / "tiny-qwen3", family="qwen3", seed=0)
        log.info("using the embedded tiny Qwen3-style model at %s", path)
        resolved = resolved.model_copy(update={"hf_checkpoint": str(path)})
    if not resolved.prompt_data:
        from vime_core.demo.task import write_dataset

        path = write_dataset(assets / "arith.jsonl", seed=0)
        resolved = resolved.model_copy(update={"prompt_data": str(path)})
        if not resolved.eval_prompt_data:
            resolved = resolved.model_copy(update={"eval_prompt_data": str(path)})
    for field in ("ref_load", "critic_load"):  # read by the trainer actors, after the engines started
        value = getattr(resolved, field)
        if value and not _is_remote(value) and not Path(value.removeprefix("file://")).exists():
            raise FileNotFoundError(f"{field}: {value} does not exist")
    check_source(resolved.prompt_data, resolved.prompt_data_split, resolved.input_key)
    if resolved.eval_prompt_data:
        eval_split = resolved.eval_prompt_data_split or resolved.prompt_data_split
        check_source(resolved.eval_prompt_data, eval_split, resolved.input_key, field="eval_prompt_data")
    return resolved
