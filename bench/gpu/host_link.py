"""The host link's bandwidth, the bound of a sleep or wake that moves bytes over it: pinned host
memory to the device and back, one large copy each way, median over repeats (GB = 1e9 bytes).

    python bench/gpu/host_link.py --gib 8 --repeats 5 --out link.json"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from gpu_common import write_json  # noqa: E402


def copy_gbps(dst: torch.Tensor, src: torch.Tensor, repeats: int) -> list[float]:
    """GB/s of `dst.copy_(src)` per repeat, the device synchronised around each."""
    rates = []
    for _ in range(repeats):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        dst.copy_(src, non_blocking=True)
        torch.cuda.synchronize()
        rates.append(src.numel() * src.element_size() / (time.perf_counter() - t0) / 1e9)
    return rates


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--gib", type=float, default=8.0, help="bytes per copy, GiB")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--out", default=None)
    a = p.parse_args(argv)
    if not torch.cuda.is_available():
        raise SystemExit("host_link.py needs a CUDA device")
    n = int(a.gib * 2**30)
    host = torch.empty(n, dtype=torch.uint8, pin_memory=True)
    device = torch.empty(n, dtype=torch.uint8, device="cuda")
    copy_gbps(device, host, 1)  # the first copy maps the pages
    h2d = copy_gbps(device, host, a.repeats)
    d2h = copy_gbps(host, device, a.repeats)
    write_json(
        {
            "bench": "host_link",
            "device": torch.cuda.get_device_name(),
            "bytes_per_copy": n,
            "h2d_gbps": statistics.median(h2d),
            "d2h_gbps": statistics.median(d2h),
            "h2d_gbps_each": h2d,
            "d2h_gbps_each": d2h,
        },
        a.out,
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
