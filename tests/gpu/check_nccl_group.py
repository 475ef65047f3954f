"""The `nccl` carrier of the broadcast weight transport (vime_core/wire/
broadcast_group.py) on real GPUs, without vLLM: prints JSON.

One GPU: a group of one (mint the id, ncclCommInitRank, broadcast, close) checks the C-API
bindings. Two or more GPUs: rank 0 on GPU 0 broadcasts BYTES to one process per other GPU,
REPEATS times; every receiver checks the bytes, and the JSON has each broadcast's seconds and
the median bandwidth (the limit a publish of that many bytes can reach).

`--init-timeout S` also asks for a group of two that no peer joins: rank 0's init must give up
after S seconds with TimeoutError (NCCL's own init would wait forever), and the GPU must still
take a group after that.

    python tests/gpu/check_nccl_group.py [--bytes N] [--repeats R] [--init-timeout S]

tests/gpu/test_nccl_group.py runs it as pass/fail checks. With two GPUs and the bytes of a
model's bf16 weights it is also the bandwidth a publish can reach.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch
import torch.multiprocessing as mp

from vime_core.wire.broadcast_group import NcclGroup, mint_nccl_unique_id


def pattern(nbytes: int, device: torch.device) -> torch.Tensor:
    return (torch.arange(nbytes, device=device, dtype=torch.int64) % 251).to(torch.uint8)


def receiver(rank: int, world: int, unique_id: str, nbytes: int, repeats: int, out: "mp.Queue") -> None:
    device = torch.device("cuda", rank)
    torch.cuda.set_device(device)
    group = NcclGroup(unique_id, rank, world, device)
    expected = pattern(nbytes, device)
    ok = True
    for _ in range(repeats):
        buffer = torch.zeros(nbytes, dtype=torch.uint8, device=device)
        group.broadcast(buffer)
        ok = ok and bool(torch.equal(buffer, expected))
    group.close()
    out.put({"rank": rank, "bytes_equal": ok})


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--bytes", type=int, default=1 << 30)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--init-timeout", type=float, default=None)
    args = parser.parse_args()
    gpus = torch.cuda.device_count()
    device = torch.device("cuda", 0)
    torch.cuda.set_device(device)
    result: dict = {"gpus": gpus, "nccl": str(torch.cuda.nccl.version()), "bytes": args.bytes}
    unique_id = mint_nccl_unique_id()
    world = max(gpus, 1)
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    procs = [
        ctx.Process(target=receiver, args=(r, world, unique_id, args.bytes, args.repeats, out)) for r in range(1, world)
    ]
    for p in procs:
        p.start()
    t0 = time.perf_counter()
    group = NcclGroup(unique_id, 0, world, device)
    result["init_s"] = time.perf_counter() - t0
    source = pattern(args.bytes, device)
    seconds = []
    for _ in range(args.repeats):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        group.broadcast(source)
        seconds.append(time.perf_counter() - t0)
    group.close()
    result["receivers"] = [out.get(timeout=120) for _ in procs]
    for p in procs:
        p.join(timeout=60)
    result["broadcast_s"] = seconds
    result["median_s"] = statistics.median(seconds)
    result["median_GBps"] = args.bytes / result["median_s"] / 1e9 if world > 1 else None
    result["ok"] = all(r["bytes_equal"] for r in result["receivers"])
    if args.init_timeout is not None:
        result["no_peer"] = no_peer_joins(device, args.init_timeout)
        result["ok"] = result["ok"] and result["no_peer"]["ok"]
    print(json.dumps(result))


def no_peer_joins(device: torch.device, timeout_s: float) -> dict:
    """A group of two whose second rank never comes: the seconds until rank 0 gave up and what it
    raised; then a group of one on the same GPU, to show the abandoned init left it usable."""
    t0 = time.perf_counter()
    try:
        NcclGroup(mint_nccl_unique_id(), 0, 2, device, timeout_s=timeout_s)
        raised = None
    except Exception as exc:  # what the caller sees
        raised = f"{type(exc).__name__}: {exc}"
    seconds = time.perf_counter() - t0
    try:
        after = NcclGroup(mint_nccl_unique_id(), 0, 1, device)
        after.broadcast(pattern(1 << 20, device))
        after.close()
        after_error = None
    except Exception as exc:  # the GPU refused a group after the abandoned init
        after_error = f"{type(exc).__name__}: {exc}"
    return {
        "timeout_s": timeout_s,
        "seconds": seconds,
        "raised": raised,
        "group_of_one_after": after_error is None,
        "group_of_one_error": after_error,
        "ok": raised is not None
        and raised.startswith("TimeoutError")
        and seconds < timeout_s + 5
        and after_error is None,
    }


if __name__ == "__main__":
    main()
