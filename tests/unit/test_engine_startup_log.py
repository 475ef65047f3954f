"""Where a vLLM server's start went, read from its log (vime_core/engines/startup_log.py): the
seconds from vime's launch line to each milestone, vLLM's own figures, and whether the compile
cache answered. The lines follow vLLM 0.26's formats (the logger calls named in the module)."""

from __future__ import annotations

import time

from vime_core.engines.startup_log import describe, launch_line, startup_marks

LAUNCH = time.mktime((2026, 12, 3, 16, 0, 0, 0, 0, -1))  # local time, as vLLM stamps its lines


def _line(offset_s: int, text: str, who: str = "EngineCore_DP0 pid=41") -> str:
    return f"({who}) INFO {time.strftime('%m-%d %H:%M:%S', time.localtime(LAUNCH + offset_s))} [x.py:1] {text}\n"


def _log(compile_lines: list[str], relaunch: bool = False) -> str:
    text = launch_line(LAUNCH) + _line(40, "non-default args: {'model': 'M'}", "APIServer pid=40")
    text += _line(52, "Loading weights took 0.41 seconds") + _line(53, "Model loading took 0.93 GiB and 1.2 seconds")
    text += _line(55, "Dynamo bytecode transform time: 4.10 s")
    text += "".join(compile_lines)
    text += _line(75, "torch.compile took 19.84 s in total")
    text += _line(80, "Graph capturing finished in 5 secs, took 0.50 GiB")
    text += _line(97, "init engine (profile, create kv cache, warmup model) took 45.20 s")
    text += _line(99, "Available routes are:", "APIServer pid=40") + "INFO:     Application startup complete.\n"
    if relaunch:  # a restarted server appends to its log: the last launch counts
        text = "(APIServer pid=9) INFO 12-03 15:00:00 [x.py:1] non-default args: {}\n" + text
    return text


def test_a_compiled_start_is_a_miss_with_the_seconds_of_each_milestone():
    compiled = [
        _line(60, "Compiling a graph for compile range (1, 8192) takes 7.25 s"),
        _line(70, "Compiling a graph for compile range (1, 8192) takes 6.50 s"),
    ]
    marks = startup_marks(_log(compiled, relaunch=True))
    assert marks["launched_epoch"] == round(LAUNCH, 3)
    assert marks["marks_s"] == {
        "args": 40,
        "weights_loaded": 52,
        "model_loaded": 53,
        "compiled": 75,
        "graphs_captured": 80,
        "engine_ready": 97,
        "serving": 99,
    }
    assert marks["compile_cache"] == "miss" and marks["compile_s"] == 7.25 + 6.50
    assert marks["torch_compile_s"] == 19.84 and marks["dynamo_s"] == 4.10
    assert marks["graph_capture_s"] == 5 and marks["engine_init_s"] == 45.20
    assert "serving 99.0s" in describe(marks) and describe(marks).endswith("compile cache miss")


def test_a_start_from_the_compile_cache_is_a_hit():
    hit = [
        _line(58, "Directly load AOT compilation from path /root/.cache/vllm/torch_compile_cache/torch_aot_compile/ab")
    ]
    marks = startup_marks(_log(hit))
    assert marks["compile_cache"] == "hit" and "compile_s" not in marks


def test_an_unloadable_cache_entry_is_told_apart():
    failed = [
        _line(58, "Compiling model again due to a load failure from /c/x, reason: bad magic"),
        _line(70, "Compiling a graph for compile range (1, 8192) takes 9.00 s"),
    ]
    assert startup_marks(_log(failed))["compile_cache"] == "load_failure"


def test_a_log_without_vllm_lines_says_so():
    marks = startup_marks(launch_line(LAUNCH) + "Traceback (most recent call last):\n")
    assert marks["marks_s"] == {} and marks["compile_cache"] is None
    assert describe(marks) == "no vLLM milestones in its log"
