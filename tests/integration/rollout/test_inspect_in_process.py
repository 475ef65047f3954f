"""`VIME_VLLM_INSPECT_IN_PROCESS=1` (vllm_side/api_server.inspect_models_in_process) against vLLM's
own model registry: a cold `modelinfos` cache is filled by an inspection in the calling process,
with no subprocess started, and an inspection that fails there still runs vLLM's way."""

from __future__ import annotations

import json
import subprocess

import pytest

pytestmark = pytest.mark.timeout(300)

SCRIPT = r"""
import json, os, sys
os.environ["VLLM_CACHE_ROOT"] = sys.argv[1]
from vllm.model_executor.models import registry

registry._run_in_subprocess = lambda fn: "vLLM's subprocess"  # what runs when the inspection here fails
from vime_core.engines.vllm_side.api_server import inspect_models_in_process
inspect_models_in_process()
fallback = registry._run_in_subprocess(lambda: 1 / 0)

run = registry.subprocess.run

def refuse_the_inspection(args, *rest, **kwargs):  # other subprocesses (platform probes) may run
    if list(args) == list(registry._SUBPROCESS_COMMAND):
        raise AssertionError("vLLM's inspection subprocess was started")
    return run(args, *rest, **kwargs)

registry.subprocess.run = refuse_the_inspection
model = registry._LazyRegisteredModel(module_name="vllm.model_executor.models.qwen3", class_name="Qwen3ForCausalLM")
info = model.inspect_model_cls()
cached = model._load_modelinfo_from_cache(model._get_modelinfo_module_hash(
    __import__("pathlib").Path(registry.__file__).parent / "qwen3.py"))
print(json.dumps({
    "fallback": fallback,
    "files": sorted(os.listdir(os.path.join(sys.argv[1], "modelinfos"))),
    "text_generation": info.is_text_generation_model,
    "cache_hit": cached is not None and cached.is_text_generation_model,
}))
"""


def test_a_cold_model_info_cache_is_filled_without_a_subprocess(vllm_python, repo_root, tmp_path):
    out = subprocess.run(
        [vllm_python, "-c", SCRIPT, str(tmp_path / "vllm-cache")],
        cwd=repo_root,
        env={"PYTHONPATH": str(repo_root), "PATH": "/usr/bin:/bin", "HOME": str(tmp_path)},
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    got = json.loads(out.stdout.strip().splitlines()[-1])
    assert got["fallback"] == "vLLM's subprocess"
    assert got["files"] == ["vllm-model_executor-models-qwen3-Qwen3ForCausalLM.json"]
    assert got["text_generation"] is True and got["cache_hit"] is True  # vLLM's next lookup reads it
