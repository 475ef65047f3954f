"""Where a vLLM server's start went, read from its log: the seconds from the launch line `EngineServer`
writes to each milestone vLLM logs, and whether vLLM's compile cache answered (vLLM 0.26's and 0.32's
formats)."""

from __future__ import annotations

import datetime as dt
import re
import time
from typing import Any, Optional

LAUNCH_PREFIX = "[vime] launched at epoch "
MILESTONES = (
    ("args", "non-default args"),
    ("weights_loaded", "Loading weights took"),
    ("model_loaded", "Model loading took"),
    ("compiled", "torch.compile took"),
    ("graphs_captured", "Graph capturing finished"),
    ("engine_ready", "init engine (profile, create kv cache, warmup model) took"),
    ("serving", "Available routes are"),
)
# vLLM's own figures: name -> pattern of the number in its line
REPORTED = {
    "torch_compile_s": re.compile(r"torch\.compile took ([\d.]+) s"),
    "dynamo_s": re.compile(r"Dynamo bytecode transform time: ([\d.]+) s"),
    "graph_capture_s": re.compile(r"Graph capturing finished in ([\d.]+) sec"),
    "engine_init_s": re.compile(r"init engine \(profile, create kv cache, warmup model\) took ([\d.]+) s"),
}
COMPILED_RANGE = re.compile(r"Compiling a graph for compile range .* takes ([\d.]+) s")
CACHE_HIT = ("Directly load AOT compilation from path", "Directly load the compiled graph(s)")
CACHE_LOAD_FAILURE = "Compiling model again due to a load failure"
STAMP = re.compile(r"\b(\d\d)-(\d\d) (\d\d):(\d\d):(\d\d)(?:[.,](\d+))?\b")


def launch_line(epoch: Optional[float] = None) -> str:
    """The line written to the server's log just before it is launched."""
    epoch = time.time() if epoch is None else epoch
    return f"{LAUNCH_PREFIX}{epoch:.3f} ({time.strftime('%m-%d %H:%M:%S', time.localtime(epoch))} local)\n"


def _stamp(line: str, year: int) -> Optional[float]:
    """The epoch of a vLLM log line's local-time stamp (its year is the launch's)."""
    m = STAMP.search(line)
    if not m:
        return None
    month, day, hour, minute, second = (int(g) for g in m.groups()[:5])
    fraction = float("0." + m.group(6)) if m.group(6) else 0.0
    try:
        return dt.datetime(year, month, day, hour, minute, second).timestamp() + fraction
    except ValueError:
        return None


def startup_marks(text: str) -> dict[str, Any]:
    """Milestones of a server log's text (its last launch when the log holds several: a restarted server
    appends to its log), in seconds from the launch line to its first line:

        args            vLLM's "non-default args" line: the interpreter and vLLM's imports are done
        weights_loaded  "Loading weights took"
        model_loaded    "Model loading took"
        compiled        "torch.compile took" (also printed when the graphs came from the cache)
        graphs_captured "Graph capturing finished"
        engine_ready    "init engine (profile, create kv cache, warmup model) took"
        serving         "Available routes are"

    and what vLLM reports: torch_compile_s, dynamo_s, compile_s (0 on a cache hit), graph_capture_s,
    engine_init_s; compile_cache "hit", "miss", "load_failure" or None (no compile)."""
    start = text.rfind(LAUNCH_PREFIX)
    launched: Optional[float] = None
    if start >= 0:
        text = text[start:]
        launched = float(text[len(LAUNCH_PREFIX) :].split(None, 1)[0])
    year = time.localtime(launched if launched is not None else time.time()).tm_year
    out: dict[str, Any] = {"launched_epoch": launched, "marks_s": {}, "compile_cache": None}
    compile_s, compiled_any = 0.0, False
    for line in text.splitlines():
        for name, needle in MILESTONES:
            if needle in line and name not in out["marks_s"] and launched is not None:
                stamp = _stamp(line, year)
                if stamp is not None:
                    out["marks_s"][name] = round(stamp - launched, 3)
        for name, pattern in REPORTED.items():
            if name not in out and (m := pattern.search(line)):
                out[name] = float(m.group(1))
        if m := COMPILED_RANGE.search(line):
            compile_s += float(m.group(1))
            compiled_any = True
        if any(needle in line for needle in CACHE_HIT) and out["compile_cache"] is None:
            out["compile_cache"] = "hit"
        if CACHE_LOAD_FAILURE in line:
            out["compile_cache"] = "load_failure"
    if compiled_any:
        out["compile_s"] = round(compile_s, 3)
        if out["compile_cache"] != "load_failure":
            out["compile_cache"] = "miss"
    return out


def describe(marks: dict[str, Any]) -> str:
    """One line for the engine's log: the milestones' seconds and the compile cache's answer."""
    parts = [f"{name} {seconds:.1f}s" for name, seconds in marks.get("marks_s", {}).items()]
    if marks.get("compile_cache"):
        parts.append(f"compile cache {marks['compile_cache']}")
    return ", ".join(parts) or "no vLLM milestones in its log"


def main(argv: Optional[list[str]] = None) -> int:
    """`python -m vime_core.engines.startup_log LOG...`: each log's figures as one JSON object."""
    import json
    import sys
    from pathlib import Path

    paths = sys.argv[1:] if argv is None else argv
    print(json.dumps({p: startup_marks(Path(p).read_text(errors="replace")) for p in paths}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
