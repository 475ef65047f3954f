"""Hold all but `--leave-gib` of a GPU's free memory until killed: another tenant taking the
memory a sleeping engine gave back, so that its wake runs out of memory (the wake failure
tests/gpu/check_stopped_asleep.sh checks with HARM=hog).

    python3 tests/gpu/hold_device_memory.py --leave-gib 0.25 --ready /tmp/hog.ready
Writes the bytes it holds to --ready once they are allocated, then sleeps until SIGTERM/SIGKILL."""

from __future__ import annotations

import argparse
import json
import os
import signal
import time

import torch


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--leave-gib", type=float, default=0.25, help="free memory left to others")
    parser.add_argument("--ready", required=True, help="file written once the memory is held")
    parser.add_argument("--device", type=int, default=0)
    args = parser.parse_args()
    torch.cuda.set_device(args.device)
    free, total = torch.cuda.mem_get_info()  # after this process's own context
    take = max(0, free - int(args.leave_gib * 2**30))
    held = torch.empty(take, dtype=torch.uint8, device="cuda")
    torch.cuda.synchronize()
    free_after, _ = torch.cuda.mem_get_info()
    tmp = f"{args.ready}.{os.getpid()}.tmp"
    with open(tmp, "w") as f:
        json.dump({"held_bytes": held.numel(), "free_before": free, "free_after": free_after, "total": total}, f)
    os.replace(tmp, args.ready)
    signal.signal(signal.SIGTERM, lambda *_: os._exit(0))
    while True:
        time.sleep(3600)


if __name__ == "__main__":
    main()
