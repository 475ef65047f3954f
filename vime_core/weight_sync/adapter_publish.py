"""Publish a LoRA adapter into running vLLM engines as version `new_version` (`lora_publish=adapter`;
the engines serve the frozen base weights and load adapters, `vime_core/engines/adapters.py`).

    validate  every adapted module against every engine's model (`weight_spec`): its weight
              exists and B A has its shape; a mismatch raises here and the engines never notice
    write     the PEFT folder (`peft_export.write_adapter_files`) under `root`, in the engines'
              served dtype, once for all engines: they read it from their machine's filesystem
              (tmpfs by default)
    pause     every engine with mode abort: a request's adapter is fixed at admission, so a
              request kept across the publish would go on with the old adapter under the new
              version; aborted requests come back partial and are continued with the new one
    load      `/v1/load_lora_adapter` as `adapter_name(new_version)` on every engine
    version   every engine reports `new_version` (`update_weight_version`)
    resume
    verify    every engine reports `new_version` and serves the new name
    retire    adapters older than the previous version are unloaded and their folders deleted;
              the previous one stays for requests sent before their client moved on

An engine that already serves the version's name keeps it (a repeated publish, or one that
brings a restarted engine up to the others' version). Failure before the version is set: the
new name is unloaded where it was loaded, the engines resume, serve what they served before and
report the old version; the error names the engine. Failure after that:
`PublishError(bytes_moved=True)`, the engines stay paused.

Why a folder and not tensors through the worker extension: vLLM's only way to load an adapter
into its workers (`add_lora` -> `WorkerLoRAManager._load_adapter`) reads a PEFT folder at the
request's `lora_path`, and the API server maps a name to an adapter only through the same route;
tensors would need a private loader of vLLM's replaced in every worker. The bytes would cross
tmpfs on CPU anyway, and vLLM stages every adapter on the host before copying it to the device.
"""

from __future__ import annotations

import asyncio
import os
import shutil
import tempfile
from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Any

import torch

from vime_core.engines.adapters import (
    ADAPTER_PREFIX,
    adapter_name,
    adapter_version,
    load_adapter,
    served_adapters,
    unload_adapter,
)
from vime_core.engines.client import EngineClient, call_all, run_blocking
from vime_core.models.lora_merge import adapter_pairs
from vime_core.models.peft_adapter import write_adapter_files
from vime_core.utils.timing import PhaseClock
from vime_core.weight_sync.publish import PublishError
from vime_core.weight_sync.weight_spec import WeightSpecError, fetch_spec

if TYPE_CHECKING:
    from vime_core.engines.auth import EngineToken


def check_adapter_against_spec(
    adapter: Mapping[str, torch.Tensor], spec: dict[str, Any], engine: str
) -> dict[str, list[int]]:
    """Raise `WeightSpecError` naming the module and engine when an adapted weight is not in the
    engine's model or B A has another shape; else {weight name: [out, in]}."""
    expected = spec["tensors"]
    shapes = {}
    for name, (a, b) in adapter_pairs(adapter).items():
        if name not in expected:
            raise WeightSpecError(f"adapter publish to engine {engine}: the model has no weight {name!r} to adapt")
        shape = [int(b.shape[0]), int(a.shape[1])]
        if shape != list(expected[name]["shape"]):
            raise WeightSpecError(
                f"adapter publish to engine {engine}: adapter of {name!r} is {shape}, the weight is "
                f"{list(expected[name]['shape'])}"
            )
        shapes[name] = shape
    return shapes


def publish_adapter(
    adapter: Mapping[str, torch.Tensor],
    settings: Mapping[str, Any],
    engine_urls: Sequence[str],
    new_version: int,
    base_model: str,
    *,
    root: str = "/dev/shm",
    token: "EngineToken | None" = None,
    client_factory: "Callable[[str], EngineClient] | None" = None,
) -> dict[str, Any]:
    """Blocking entry point (module docstring). `adapter`: PEFT-named tensors (`lora_hf_state`),
    `settings`: `lora_settings(cfg)`, `base_model`: the engines' checkpoint (recorded in the
    folder). Returns stats: version, adapter (its name), folder, engines, tensors, bytes,
    seconds per phase (+ "total"), retired (names unloaded)."""
    factory = client_factory or (lambda url: EngineClient(url, token=token))
    return run_blocking(
        lambda: publish_adapter_async(
            adapter, settings, engine_urls, new_version, base_model, root=root, client_factory=factory
        )
    )


async def publish_adapter_async(
    adapter: Mapping[str, torch.Tensor],
    settings: Mapping[str, Any],
    engine_urls: Sequence[str],
    new_version: int,
    base_model: str,
    *,
    root: str,
    client_factory: "Callable[[str], EngineClient]",
) -> dict[str, Any]:
    if not engine_urls:
        raise ValueError("publish_adapter: engine_urls is empty")
    if not os.path.isdir(root):
        raise FileNotFoundError(f"adapter publish: folder {root!r} does not exist")
    clock = PhaseClock()
    engines = [client_factory(url) for url in engine_urls]
    name = adapter_name(new_version)
    folder = None
    try:
        with clock("validate"):
            specs = await asyncio.gather(*(fetch_spec(e) for e in engines))
            for engine, spec in zip(engines, specs):
                check_adapter_against_spec(adapter, spec, engine.name)
                if spec["served_dtype"] != specs[0]["served_dtype"]:
                    raise WeightSpecError(f"engine {engine.name} serves other dtypes than {engines[0].name}")
        with clock("write"):  # in the served dtype, which vLLM casts adapters to (lora_dtype auto)
            dtype = getattr(torch, specs[0]["served_dtype"])
            folder = tempfile.mkdtemp(prefix=f"{name}-", dir=root)
            await asyncio.to_thread(write_adapter_files, adapter, settings, base_model, folder, dtype)
            nbytes = sum(t.numel() * dtype.itemsize for t in adapter.values())
        await _apply(engines, name, folder, new_version, clock)
        with clock("retire"):
            retired = await _retire(engines, new_version, root)
        if not await _serves_from(engines, name, folder):  # every engine had this version already
            shutil.rmtree(folder, ignore_errors=True)
    except BaseException:
        if folder is not None and not await _serves_from(engines, name, folder):
            shutil.rmtree(folder, ignore_errors=True)
        raise
    finally:
        await asyncio.gather(*(e.aclose() for e in engines), return_exceptions=True)
    return {
        "version": new_version,
        "adapter": name,
        "folder": folder,
        "transport": "adapter",
        "engines": len(engines),
        "tensors": len(adapter),
        "bytes": nbytes,
        "seconds": {**clock.seconds, "total": clock.total()},
        "retired": retired,
    }


async def _apply(engines: list[EngineClient], name: str, folder: str, version: int, clock: PhaseClock) -> None:
    """pause -> load -> version -> resume -> verify; undo what can be undone (module docstring).
    An engine that already serves `name` (a publish of this version repeated) keeps it."""
    loaded: list[EngineClient] = []

    async def load(engine: EngineClient) -> None:
        if name in await served_adapters(engine):
            return
        await load_adapter(engine, name, folder)
        loaded.append(engine)

    with clock("pause"):
        await call_all(engines, "pause", "abort")
    try:
        with clock("load"):
            await asyncio.gather(*(load(e) for e in engines))
    except BaseException as err:
        undo = await asyncio.gather(*(unload_adapter(e, name) for e in loaded), return_exceptions=True)
        undo += await asyncio.gather(*(e.resume() for e in engines), return_exceptions=True)
        if failed := [u for u in undo if isinstance(u, BaseException)]:
            err.add_note(f"undoing the adapter publish failed as well: {failed[0]}")
        raise
    try:
        with clock("version"):
            await call_all(engines, "update_weight_version", version)
        with clock("resume"):
            await call_all(engines, "resume")
        with clock("verify"):
            versions = await call_all(engines, "weight_version")
            served = await asyncio.gather(*(served_adapters(e) for e in engines))
    except BaseException as err:
        raise PublishError(
            f"adapter publish v{version} failed after {name} was loaded ({err}); the engines may disagree on "
            "their version and stay paused: publish again or restart them",
            bytes_moved=True,
        ) from err
    wrong = [f"{e.name} reports v{v}" for e, v in zip(engines, versions) if v != version]
    wrong += [f"{e.name} does not serve {name}" for e, s in zip(engines, served) if name not in s]
    if wrong:
        raise PublishError(f"adapter publish v{version}: {', '.join(wrong)}", bytes_moved=True)


async def _retire(engines: list[EngineClient], version: int, root: str) -> list[str]:
    """Unload the vime adapters older than version - 1 and delete their folders under `root`."""
    retired: set[str] = set()
    for engine in engines:
        for name, folder in (await served_adapters(engine)).items():
            if adapter_version(name) < version - 1:  # type: ignore[operator]
                await unload_adapter(engine, name)
                retired.add(name)
                if os.path.dirname(os.path.realpath(folder)) == os.path.realpath(root) and os.path.basename(
                    folder
                ).startswith(ADAPTER_PREFIX):
                    shutil.rmtree(folder, ignore_errors=True)
    return sorted(retired)


async def _serves_from(engines: list[EngineClient], name: str, folder: str) -> bool:
    """Whether any engine has `name` registered from `folder` (which must then stay); True
    also when an engine cannot say."""
    answers = await asyncio.gather(*(served_adapters(e) for e in engines), return_exceptions=True)
    return any(isinstance(a, BaseException) or a.get(name) == folder for a in answers)
