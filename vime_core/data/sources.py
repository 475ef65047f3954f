"""Where prompt records come from: a file, a local dataset folder, or a hub dataset. The first rule
that matches `prompt_data` (or `eval_prompt_data`) decides:

    1. contains "://"                         -> file   (fsspec URI)
    2. ends with .jsonl, .json or .parquet    -> file   (local path)
    3. an existing local directory            -> folder (save_to_disk, else its data files)
    4. an existing local file                 -> file   (any other suffix: "unknown format")
    5. `namespace/name[:config]`, not on disk -> hub    (from the HF datasets cache inside actors)
    6. anything else                          -> file   ("does not exist")

Every kind gives the same rows in a fixed order, so the data source resumes the same way for each."""

from __future__ import annotations

import contextlib
import json
import os
import re
from pathlib import Path
from typing import Any, Literal

FILE_SUFFIXES = (".jsonl", ".json", ".parquet")
HUB_NAME = re.compile(r"^[A-Za-z0-9][\w.-]*/[A-Za-z0-9][\w.-]*(:[\w.-]+)?$")

SourceKind = Literal["file", "folder", "hub"]


def source_kind(spec: str) -> SourceKind:
    """Which kind of source `spec` names (module docstring, rules 1-6)."""
    if "://" in spec or spec.lower().endswith(FILE_SUFFIXES):
        return "file"
    path = Path(spec).expanduser()
    if path.is_dir():
        return "folder"
    if path.exists():
        return "file"
    return "hub" if _hub_name(spec) else "file"


def _hub_name(spec: str) -> bool:
    return "://" not in spec and not spec.lower().endswith(FILE_SUFFIXES) and bool(HUB_NAME.match(spec))


def resolve_local(spec: str, base: Path) -> str:
    """`spec` for actors that do not share the driver's working directory: a local path made
    absolute against `base`; URIs and hub names unchanged."""
    if not spec or ("://" in spec and not spec.startswith("file://")):
        return spec
    local = Path(spec.removeprefix("file://")).expanduser()
    absolute = local if local.is_absolute() else base / local
    if not absolute.exists() and _hub_name(spec):
        return spec
    # abspath, not resolve(): keep symlinks as the user gave them
    return os.path.abspath(absolute)


def describe(spec: str, split: str) -> str:
    """The source as messages name it: the file, the folder or hub name with its split (a
    `Dataset.save_to_disk` folder has none)."""
    kind = source_kind(spec)
    if kind == "file" or (kind == "folder" and (Path(spec).expanduser() / "state.json").is_file()):
        return spec
    return f"{spec} (split {split!r})"


def read_records(spec: str, split: str) -> list[dict]:
    """Every row of the source as a dict of column -> value, in the source's order."""
    kind = source_kind(spec)
    if kind == "file":
        return _read_file(spec)
    dataset = _load_folder(spec, split) if kind == "folder" else _load_hub(spec, split)
    return dataset.to_list()


# ---- files (JSONL / JSON / Parquet, local or fsspec) ---------------------------------------------


def _read_file(path: str) -> list[dict]:
    # boundary: `vime train --help` imports this module (the configuration's chat-template check)
    import fsspec

    lower = path.lower()
    try:
        if lower.endswith(".parquet"):
            import pyarrow.parquet as pq  # boundary: `vime train --help` imports this module (pyarrow)

            with fsspec.open(path, "rb") as f:
                return pq.read_table(f).to_pylist()
        if lower.endswith((".jsonl", ".json")):
            with fsspec.open(path, "rt", encoding="utf-8") as f:
                text = f.read()
        else:
            raise ValueError(
                f"prompt data {path}: unknown format; use .jsonl, .json or .parquet, a dataset folder, "
                "or a hub dataset namespace/name"
            )
    except FileNotFoundError:
        raise FileNotFoundError(f"prompt data {path} does not exist") from None
    if lower.endswith(".json") and text.lstrip().startswith("["):
        records = json.loads(text)
    else:
        records = []
        for lineno, line in enumerate(text.splitlines(), 1):
            if not line.strip():
                continue
            try:
                records.append(json.loads(line))
            except json.JSONDecodeError as exc:
                raise ValueError(f"prompt data {path}, line {lineno}: not JSON ({exc.msg})") from None
    for i, r in enumerate(records):
        if not isinstance(r, dict):
            raise ValueError(f"prompt data {path}, record {i}: expected an object, got {type(r).__name__}")
    return records


# ---- datasets (folders and hub names) --------------------------------------------------------------


def _datasets():
    try:
        import datasets  # boundary: optional and heavy, only for dataset folders and hub names
    except ImportError:
        raise ImportError(
            "prompt data from a dataset folder or a hub name needs the `datasets` package "
            "(pinned in requirements/trainer.lock.txt: run infra/setup_env.sh)"
        ) from None
    return datasets


@contextlib.contextmanager
def _quiet(datasets):
    """No per-split progress bars in the run's log while a dataset loads."""
    was_disabled = datasets.utils.are_progress_bars_disabled()
    datasets.utils.disable_progress_bars()
    try:
        yield
    finally:
        if not was_disabled:
            datasets.utils.enable_progress_bars()


def _load_folder(folder: str, split: str):
    """The datasets.Dataset of a local folder (module docstring, rule 3)."""
    datasets = _datasets()
    path = Path(folder).expanduser()
    with _quiet(datasets):
        if (path / "dataset_dict.json").is_file():  # DatasetDict.save_to_disk
            loaded = datasets.load_from_disk(str(path))
            if split not in loaded:
                raise ValueError(
                    f"prompt data {folder}: no split {split!r} (prompt_data_split); splits: {sorted(loaded)}"
                )
            return loaded[split]
        if (path / "state.json").is_file():  # Dataset.save_to_disk: one table, no splits
            return datasets.load_from_disk(str(path))
        try:
            return datasets.load_dataset(str(path), split=split)
        except ValueError as exc:
            if "Unknown split" in str(exc):
                raise ValueError(f"prompt data {folder}: no split {split!r} (prompt_data_split): {exc}") from None
            raise
        except FileNotFoundError as exc:  # EmptyDatasetError, DataFilesNotFoundError
            raise FileNotFoundError(
                f"prompt data {folder}: neither a save_to_disk folder nor a folder of data files that "
                f"datasets.load_dataset reads ({exc})"
            ) from None


def _load_hub(spec: str, split: str):
    """The datasets.Dataset of a hub name (module docstring, rule 5)."""
    datasets = _datasets()
    name, _, config = spec.partition(":")
    with _quiet(datasets):
        try:
            return datasets.load_dataset(name, config or None, split=split)
        except ValueError as exc:
            if "Unknown split" in str(exc):
                raise ValueError(f"prompt data {spec}: no split {split!r} (prompt_data_split): {exc}") from None
            raise ValueError(f"prompt data {spec}: {exc}") from None
        except (OSError, datasets.exceptions.DatasetNotFoundError) as exc:  # ConnectionError, FileNotFoundError
            where = (
                f"not in the HF datasets cache {datasets.config.HF_DATASETS_CACHE} and HF_HUB_OFFLINE=1"
                if datasets.config.HF_HUB_OFFLINE
                else "could not be loaded"
            )
            raise FileNotFoundError(
                f"prompt data {spec}: no local file or folder of that name, and the hub dataset {name!r} is "
                f"{where} ({exc})"
            ) from None


def check_source(spec: str, split: str, input_key: str, field: str = "prompt_data") -> None:
    """Fail early, on the driver before any actor or server starts, when a dataset folder or hub
    dataset cannot be loaded or has no `input_key` column. A hub dataset is downloaded into the
    HF datasets cache here when the hub can be reached, so the actors (HF_HUB_OFFLINE=1) find it
    there. Files are read by the actors only (they may be large or remote)."""
    kind = source_kind(spec)
    if kind == "file":
        return
    dataset = _load_folder(spec, split) if kind == "folder" else _load_hub(spec, split)
    if input_key not in dataset.column_names:
        raise KeyError(
            (
                f"{field} {spec} (split {split!r}): no column {input_key!r} (input_key); columns: "
                f"{sorted(dataset.column_names)}"
            )
        )


# ---- apply_chat_template_kwargs -------------------------------------------------------------------

# Set by the data source itself; a second value would be a TypeError deep inside the tokenizer.
RESERVED_CHAT_TEMPLATE_KWARGS = ("conversation", "tokenize", "add_generation_prompt", "return_dict")


def parse_chat_template_kwargs(value: Any) -> dict:
    """`apply_chat_template_kwargs` from a dict, or from a JSON object in a string (a flag or a
    Prefect form); anything else is a ValueError (pydantic names the field)."""
    example = "e.g. '{\"enable_thinking\": false}'"
    if value is None or value == "":
        return {}
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except json.JSONDecodeError as exc:
            raise ValueError(f"not JSON ({exc.msg}); give a JSON object, {example}") from None
    if not isinstance(value, dict):
        raise ValueError(f"must be a JSON object, {example}; got {type(value).__name__}")
    reserved = sorted(set(value) & set(RESERVED_CHAT_TEMPLATE_KWARGS))
    if reserved:
        raise ValueError(f"{reserved} are set by vime itself; leave them out")
    return value
