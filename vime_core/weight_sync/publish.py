"""Publish the trainer's HF-named weights into running vLLM engines as version `new_version` (the sync
phase; the first publish at startup is version 1): gather, validate against every engine's weight
spec before anything moves, pause, start the session (resetting the prefix cache when flushing),
send buckets, finish, resume, verify. Control calls go to each engine directly, never through the
router (it drops query strings)."""

from __future__ import annotations

import asyncio
import functools
import itertools
from collections.abc import Callable, Iterable, Sequence
from typing import TYPE_CHECKING, Any

from vime_core.algo.gates import should_flush_cache
from vime_core.engines.client import call_all as _on_all
from vime_core.utils.errors import InfrastructureError
from vime_core.utils.timing import PhaseClock
from vime_core.weight_sync.buckets import iter_buckets
from vime_core.weight_sync.publish_loop import PublishLoop
from vime_core.weight_sync.transport import make_transport
from vime_core.weight_sync.weight_spec import check_against_spec, fetch_spec

if TYPE_CHECKING:
    import torch

    from vime_core.config.schema import VimeConfig
    from vime_core.engines.auth import EngineToken
    from vime_core.engines.client import EngineClient
    from vime_core.weight_sync.publish_loop import PublishLoop
    from vime_core.weight_sync.transport.base import WeightTransport
    from vime_core.weight_sync.transport.ipc_peers import PeerChannel


class PublishError(RuntimeError, InfrastructureError):
    """A publish that failed; `bytes_moved` says whether engines may hold a partial update."""

    def __init__(self, message: str, bytes_moved: bool) -> None:
        super().__init__(message)
        self.bytes_moved = bytes_moved

    def __reduce__(self):  # crosses Ray (pickle) with its own arguments
        return type(self), (str(self), self.bytes_moved)


def publish_weights(
    named_tensors: Iterable[tuple[str, "torch.Tensor"]],
    engine_urls: Sequence[str],
    new_version: int,
    cfg: "VimeConfig",
    initial_version: int = 0,
    *,
    transport: "WeightTransport | None" = None,
    shm_dir: str = "/dev/shm",
    client_factory: "Callable[[str], EngineClient] | None" = None,
    loop: "PublishLoop | None" = None,
    peers: "PeerChannel | None" = None,
    token: "EngineToken | None" = None,
) -> dict[str, Any]:
    """Blocking entry point for the trainer (rank 0). Returns stats: version, flushed, transport,
    engines, tensors, buckets, bytes, bytes_per_s, seconds per phase (+ "total"), and the
    transport's own split (e.g. pack vs. waiting for the engines to load).

    `loop`: the caller's PublishLoop (engine clients and bucket pools kept between its
    publishes); None makes one for this call and closes it afterwards. `peers`: the other
    trainer ranks, which pack the IPC buckets on their GPUs too (transport/ipc_peers.py).
    `token`: the engine token every call sends; None: the loop's (`PublishLoop.engine_token`:
    its own, else its token source's).

    A failure before the first tensor byte reached an engine closes the session empty (vLLM keeps the
    old weights) and the engines resume on the old version; after it, the session is closed too (so
    the next publish can open one) but the engines may hold a half-applied update under their old
    version, so they stay paused and PublishError says so: the next publish overwrites every tensor."""
    if loop is None:
        own = PublishLoop()
        try:
            return publish_weights(
                named_tensors,
                engine_urls,
                new_version,
                cfg,
                initial_version,
                transport=transport,
                shm_dir=shm_dir,
                client_factory=client_factory,
                loop=own,
                peers=peers,
                token=token,
            )
        finally:
            own.close()

    # Gather and build the transport in the caller's thread: the iterator may run collectives
    # (TP gathers) and CUDA state is per thread; the rest runs on the publish loop's thread.
    clock = PhaseClock()
    if client_factory is None:
        token = token if token is not None else loop.engine_token()
        client_factory = functools.partial(loop.client, token=token)
    with clock("gather"):
        tensors = list(named_tensors)
    return loop.run(
        publish_weights_async(
            tensors,
            engine_urls,
            new_version,
            cfg,
            initial_version,
            transport=transport if transport is not None else make_transport(cfg, shm_dir, keeper=loop, peers=peers),
            client_factory=client_factory,
            clock=clock,
        )
    )


async def publish_weights_async(
    tensors: list[tuple[str, "torch.Tensor"]],
    engine_urls: Sequence[str],
    new_version: int,
    cfg: "VimeConfig",
    initial_version: int,
    *,
    transport: "WeightTransport",
    client_factory: "Callable[[str], EngineClient]",
    clock: PhaseClock,
) -> dict[str, Any]:
    if not engine_urls:
        raise ValueError("publish_weights: engine_urls is empty")
    flush = should_flush_cache(cfg.flush_cache_interval, new_version, initial_version)
    engines = [client_factory(url) for url in engine_urls]
    try:
        with clock("validate"):  # and the transport's handshake, which changes nothing yet
            wire, _ = await asyncio.gather(_validate(tensors, engines), transport.prepare(engines))
        buckets, nbytes = await _apply(transport, tensors, wire, new_version, flush, cfg, clock)
        with clock("resume"):
            await _on_all(engines, "resume")
        with clock("verify"):
            versions = await _on_all(engines, "weight_version")
        wrong = [f"{e.name} reports {v}" for e, v in zip(engines, versions) if v != new_version]
        if wrong:
            raise PublishError(f"publish v{new_version}: {', '.join(wrong)}", bytes_moved=True)
    finally:
        await transport.close()
    total = clock.total()
    return {
        "version": new_version,
        "flushed": flush,
        "transport": transport.name,
        "engines": len(engines),
        "tensors": len(tensors),
        "buckets": buckets,
        "bytes": nbytes,
        "bytes_per_s": nbytes / total if total > 0 else 0.0,
        "seconds": {**clock.seconds, "total": total},
        "transport_seconds": dict(transport.timings),
    }


async def _validate(
    tensors: list[tuple[str, "torch.Tensor"]], engines: list["EngineClient"]
) -> dict[str, "torch.dtype"]:
    """Wire dtypes after checking against every engine; all engines must agree."""
    specs = await asyncio.gather(*(fetch_spec(e) for e in engines))
    wire: dict[str, "torch.dtype"] | None = None
    for engine, spec in zip(engines, specs):
        this = check_against_spec(tensors, spec, engine.name)
        if wire is not None and this != wire:
            raise PublishError(f"engine {engine.name} serves other dtypes than {engines[0].name}", bytes_moved=False)
        wire = this
    assert wire is not None
    return wire


async def _apply(
    transport: "WeightTransport",
    tensors: list[tuple[str, "torch.Tensor"]],
    wire: dict[str, "torch.dtype"],
    new_version: int,
    flush: bool,
    cfg: "VimeConfig",
    clock: PhaseClock,
) -> tuple[int, int]:
    """pause -> start -> buckets -> finish; on failure undo what can be undone (see the module
    docstring). Returns (buckets, bytes)."""
    engines = transport.engines
    buckets = nbytes = 0
    to_send = iter_buckets(tensors, cfg.update_weight_buffer_size, wire)
    first = next(to_send, None)
    try:
        if first is not None:
            transport.stage(first)  # packing overlaps the pause and the session start
        with clock("pause"):
            await _on_all(engines, "pause", "abort" if flush else "keep")
        with clock("start"):  # with the prefix-cache flush: both only need the engines paused
            await asyncio.gather(
                _on_all(engines, "reset_prefix_cache") if flush else asyncio.sleep(0), transport.start()
            )
        with clock("transfer"):
            for bucket in itertools.chain([first] if first is not None else [], to_send):
                await transport.send_bucket(bucket)
                buckets += 1
                nbytes += bucket.nbytes
        with clock("finish"):
            await transport.finish(new_version)
    except BaseException as err:
        try:  # close the engines' session (one left open refuses the next publish)
            await transport.abort()
            if not transport.bytes_moved:  # nothing reached them: they serve the old weights again
                await _on_all(engines, "resume")
        except Exception as undo_err:  # keep the original error; say the undo failed too
            err.add_note(f"undoing the publish failed as well: {undo_err}")
        if transport.bytes_moved:
            raise PublishError(
                f"publish v{new_version} failed after weights reached the engines ({err}); they may hold a "
                "half-applied update under their old version and stay paused: the next publish sends every "
                "tensor again (or restart them)",
                bytes_moved=True,
            ) from err
        raise
    return buckets, nbytes
