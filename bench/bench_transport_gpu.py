"""GPU weight transport (CUDA IPC) and trainer sleep/wake. For each --shapes model (random bf16, one
GPU, TP=1) the trainer's weights go to a receiving process on the same GPU as to a colocated vLLM
engine (gather, pack, handles, receive, and the same through IpcTransport), each tensor checked by
checksum, against a device-to-device copy of the same bytes; then device memory and times of a
trainer sleep and wake, and a training step after the wake.

    bench/run.py transport_gpu --shapes 0.5b,1.5b"""

from __future__ import annotations

import argparse
import asyncio
import base64
import math
import pickle
import sys
import time
import warnings
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import gc
import random

import gpu_common as common  # noqa: E402
from torch.multiprocessing.reductions import rebuild_cuda_tensor

from vime_core.engines.vllm_api import VllmApi
from vime_core.weight_sync.buckets import iter_buckets
from vime_core.weight_sync.buckets import pack_ipc as pack_bucket
from vime_core.weight_sync.transport.ipc import IpcTransport, cuda_device_uuid, default_reduce
from vime_core.wire.ipc_format import DEVICE_UUID_RPC, ipc_update_info

GB = 1e9


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shapes", default="0.5b,1.5b")
    p.add_argument("--bucket-mb", type=int, default=512, help="bytes per bucket, MiB (cfg.update_weight_buffer_size)")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--checkpoint-root", default="/tmp/vime_bench_ckpt")
    p.add_argument("--seed", type=int, default=1234)
    p.add_argument("--out", default=None)
    return p.parse_args(argv)


def checksum(t: torch.Tensor) -> int:
    """sum_j w_j * word_j over the tensor's 16-bit words, w_j = j mod 65521 + 1 (order-sensitive)."""
    words = t.detach().contiguous().view(-1).view(torch.int16).to(torch.int64)
    weights = torch.arange(words.numel(), device=words.device, dtype=torch.int64) % 65521 + 1
    return int((words * weights).sum())


# ---- the receiving process ------------------------------------------------------------------------------


def receiver_main(conn: Any, device_index: int) -> None:
    """Stand-in for a colocated engine worker: owns its weights, loads IPC buckets into them."""
    torch.cuda.set_device(device_index)
    own: dict[str, torch.Tensor] = {}
    while True:
        kind, payload = conn.recv()
        if kind == "alloc":
            own = {n: torch.empty(shape, dtype=getattr(torch, dt), device="cuda") for n, (shape, dt) in payload.items()}
            conn.send(sum(t.numel() * t.element_size() for t in own.values()))
        elif kind == "bucket":
            t0 = time.perf_counter()
            handles = pickle.loads(base64.b64decode(payload["ipc_handles_pickled"]))
            uuid = str(torch.cuda.get_device_properties(device_index).uuid)
            args = list(handles[uuid])
            args[6] = device_index  # the receiver's own index for that GPU
            buffer = rebuild_cuda_tensor(*args)
            t_open = time.perf_counter() - t0
            slices = buffer.split(payload["tensor_sizes"])
            for name, dt, shape, raw in zip(payload["names"], payload["dtype_names"], payload["shapes"], slices):
                own[name].copy_(raw.view(getattr(torch, dt)).view(shape))
            torch.cuda.synchronize()
            del buffer, slices
            conn.send({"open_s": t_open, "total_s": time.perf_counter() - t0})
        elif kind == "checksums":
            conn.send({n: checksum(t) for n, t in own.items()})
        elif kind == "free":
            own = {}
            torch.cuda.empty_cache()
            conn.send(True)
        elif kind == "stop":
            conn.send(True)
            return


class PipeEngine:
    """The EngineClient methods IpcTransport calls, forwarded to the receiving process."""

    name = "receiver"

    def __init__(self, conn: Any) -> None:
        self.conn = conn
        self.receive_s: list[float] = []
        self.open_s: list[float] = []

    async def api(self) -> Any:
        return VllmApi.for_version("0.26.0")  # the GPU hosts' release: packed flag per update

    async def collective_rpc(self, method: str, *args: Any, **kwargs: Any) -> list:
        assert method == DEVICE_UUID_RPC, method
        return [cuda_device_uuid(torch.device("cuda", torch.cuda.current_device()))]  # the receiver shares this GPU

    async def init_weight_transfer(self, info: dict) -> None:
        assert info == {}, info  # 0.26: `packed` goes in each update_info

    async def start_weight_update(self) -> None:
        return None

    async def update_weights(self, info: dict) -> None:
        self.conn.send(("bucket", info))
        reply = self.conn.recv()
        self.receive_s.append(reply["total_s"])
        self.open_s.append(reply["open_s"])

    async def finish_weight_update(self, version: int) -> None:
        return None


# ---- one model ----------------------------------------------------------------------------------------------


def gather(trainer: Any) -> list[tuple[str, torch.Tensor]]:
    return list(trainer.iter_hf_weights())


def pack_and_handles(tensors: list, bucket_bytes: int, device: torch.device) -> dict[str, Any]:
    """The transport's per-bucket work in two timed parts: packing, then handle + payload."""
    uuid = cuda_device_uuid(device)
    pack_s = handle_s = 0.0
    buffers, infos = [], []
    for bucket in iter_buckets(tensors, bucket_bytes):
        t, (buffer, sizes) = common.timed(lambda: pack_bucket(bucket, device), device.type)
        pack_s += t
        t0 = time.perf_counter()
        infos.append(ipc_update_info(bucket, sizes, {uuid: default_reduce(buffer)}))
        handle_s += time.perf_counter() - t0
        buffers.append(buffer)
    return {"pack_s": pack_s, "handles_s": handle_s, "buffers": buffers, "infos": infos}


async def publish_through_transport(tensors: list, engine: PipeEngine, bucket_bytes: int, device: torch.device) -> dict:
    """IpcTransport driven as publish._transfer drives it (prepare, start, buckets, finish, close)."""
    transport = IpcTransport(device=device)
    await transport.prepare([engine])  # type: ignore[list-item]
    await transport.start()
    buckets = 0
    try:
        for bucket in iter_buckets(tensors, bucket_bytes):
            await transport.send_bucket(bucket)
            buckets += 1
        await transport.finish(1)
    finally:
        await transport.close()
    return {"buckets": buckets, "transport_timings_s": dict(transport.timings)}


def d2d_copy_seconds(nbytes: int, repeats: int) -> float:
    src = torch.randint(0, 255, (nbytes,), dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    dst.copy_(src)
    times = [common.timed(lambda src=src, dst=dst: dst.copy_(src), "cuda")[0] for _ in range(repeats)]
    del src, dst
    return common.median(times)


def bench_shape(shape: str, conn: Any, args: argparse.Namespace) -> dict[str, Any]:
    trainer = common.build_trainer(
        shape,
        "cuda",
        1,
        args.seed,
        Path(args.checkpoint_root),
        rollout_batch_size=8,
        rollout_max_prompt_len=256,
        rollout_max_response_len=256,
        micro_batch_size=8,
        lr=1e-5,
    )
    device = torch.device("cuda", torch.cuda.current_device())
    bucket_bytes = args.bucket_mb * 2**20
    tensors = gather(trainer)
    nbytes = sum(t.numel() * t.element_size() for _, t in tensors)
    conn.send(("alloc", {n: (list(t.shape), str(t.dtype).removeprefix("torch.")) for n, t in tensors}))
    conn.recv()
    sent_sums = {n: checksum(t) for n, t in tensors}
    del tensors

    rows = []
    for _ in range(args.repeats):
        t_gather, tensors = common.timed(lambda: gather(trainer), device.type)
        parts = pack_and_handles(tensors, bucket_bytes, device)
        engine = PipeEngine(conn)
        for info in parts["infos"]:
            asyncio.run(engine.update_weights(info))
        row: dict[str, Any] = {
            "gather_s": t_gather,
            "pack_s": parts["pack_s"],
            "handles_s": parts["handles_s"],
            "open_handles_s": sum(engine.open_s),
            "receive_s": sum(engine.receive_s),
        }
        del parts
        torch.cuda.ipc_collect()
        engine_t = PipeEngine(conn)
        t_pub, pub = common.timed(
            lambda tensors=tensors: asyncio.run(publish_through_transport(tensors, engine_t, bucket_bytes, device)),
            device.type,
        )
        row.update(publish_s=t_pub, publish_receive_s=sum(engine_t.receive_s), **pub)
        del tensors
        rows.append(row)
    conn.send(("checksums", None))
    got = conn.recv()
    mismatched = sorted(n for n in sent_sums if got.get(n) != sent_sums[n])
    t_d2d = d2d_copy_seconds(nbytes, max(args.repeats, 5))
    med = {
        k: common.median([r[k] for r in rows])
        for k in ("gather_s", "pack_s", "handles_s", "open_handles_s", "receive_s", "publish_s")
    }
    end_to_end = med["gather_s"] + med["pack_s"] + med["handles_s"] + med["receive_s"]
    result = {
        "shape": shape,
        "tensors": len(sent_sums),
        "bytes": nbytes,
        "bucket_bytes": bucket_bytes,
        "buckets": rows[-1]["buckets"],
        "median_s": med,
        "receive_GBps": nbytes / med["receive_s"] / GB,
        "d2d_copy_s": t_d2d,
        "d2d_GBps": nbytes / t_d2d / GB,
        "receive_vs_d2d": t_d2d / med["receive_s"],
        "end_to_end_s": end_to_end,
        "end_to_end_GBps": nbytes / end_to_end / GB,
        "publish_through_IpcTransport_GBps": nbytes / med["publish_s"] / GB,
        "checksums_checked": len(sent_sums),
        "checksums_mismatched": mismatched[:20],
        "repeats": rows,
    }
    conn.send(("free", None))
    conn.recv()
    result["sleep_wake"] = sleep_wake(trainer)
    release(trainer)
    return result


def sleep_wake(trainer: Any) -> dict[str, Any]:
    """One training rollout (so Adam has state), then sleep, wake, and another rollout."""
    # boundary: the receiver process (spawn) imports this module and stands in for an engine: no megatron
    from vime_core.trainer.rollout_training import train_on_rollout

    rng = random.Random(0)
    vocab = trainer.arch.vocab_size
    batch = {
        "tokens": [[rng.randrange(vocab) for _ in range(512)] for _ in range(8)],
        "response_length": [256] * 8,
        "loss_mask": [[1] * 256 for _ in range(8)],
        "advantage": [rng.gauss(0, 1) for _ in range(8)],
    }
    first = train_on_rollout(trainer, batch)
    dev = trainer.device.type
    if dev == "cuda":
        torch.cuda.empty_cache()
    weights_before = sum(checksum(t) for _, t in trainer.iter_hf_weights())
    cycles = []
    for _ in range(2):  # the first sleep pins host memory; the second finds it in torch's pinned cache
        before = common.device_memory(dev)
        t_sleep, slept = common.timed(trainer.sleep, dev)
        asleep = common.device_memory(dev)
        t_wake, woke = common.timed(trainer.wake, dev)
        awake = common.device_memory(dev)
        cycles.append(
            {
                "memory_before_gib": before,
                "memory_asleep_gib": asleep,
                "memory_awake_gib": awake,
                "sleep_s": t_sleep,
                "wake_s": t_wake,
                "freed_gib": slept["freed_bytes"] / 2**30,
                "restored_gib": woke["allocated_bytes"] / 2**30,
            }
        )
    weights_after = sum(checksum(t) for _, t in trainer.iter_hf_weights())
    second = train_on_rollout(trainer, batch)
    return {
        "cycles": cycles,
        "weights_unchanged_by_sleep_wake": weights_before == weights_after,
        "loss_before_sleep": first["loss"],
        "loss_after_wake": second["loss"],
        "grad_norm_before_sleep": first["grad_norm"],
        "grad_norm_after_wake": second["grad_norm"],
        "train_after_wake_finite": math.isfinite(second["loss"]) and math.isfinite(second["grad_norm"]),
    }


def release(trainer: Any) -> None:
    trainer.model = trainer.optimizer = None
    gc.collect()
    torch.cuda.empty_cache()


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    warnings.filterwarnings("ignore")
    ctx = torch.multiprocessing.get_context("spawn")
    here, there = ctx.Pipe()
    receiver = ctx.Process(target=receiver_main, args=(there, 0), daemon=True)
    receiver.start()
    try:
        shapes = [bench_shape(s, here, args) for s in args.shapes.split(",") if s]
    finally:
        here.send(("stop", None))
        receiver.join(timeout=30)
    result = {
        "bench": "transport_gpu",
        "device": torch.cuda.get_device_name(),
        "argv": sys.argv[1:],
        "gbps_note": "GB/s = weight bytes (counted once) / seconds; the d2d baseline moves the same bytes "
        "(read + write traffic is twice that)",
        "shapes": shapes,
    }
    common.write_json(result, args.out)
    from vime_core.trainer.parallel import destroy_parallel  # boundary: as in sleep_wake (no megatron)

    destroy_parallel()


if __name__ == "__main__":
    main()
