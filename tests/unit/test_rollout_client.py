"""EngineClient / EngineServer / PolicyRouter against a tiny fake HTTP server (the engine boundary
stubbed); the real server is exercised in tests/integration/rollout."""

from __future__ import annotations

import asyncio
import json
import sys
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Callable

import pytest

from vime_core.engines.client import (
    ANSWERED_BY,
    BODY_EXCERPT_CHARS,
    EngineClient,
    EngineError,
    EngineWakeError,
    SyncEngineClient,
    normalize_wake_tags,
    parse_weight_version,
)
from vime_core.engines.health import HealthMonitor

pytestmark = pytest.mark.timeout(60)

Handler = Callable[[str, str, dict], tuple[int, object]]


class FakeEngine:
    """Answers each request with `handler(method, path_with_query, json_body) -> (status, body)`;
    records every request."""

    def __init__(self, handler: Handler) -> None:
        self.requests: list[tuple[str, str, dict, dict]] = []
        fake = self

        class H(BaseHTTPRequestHandler):
            def _serve(self) -> None:
                length = int(self.headers.get("content-length") or 0)
                body = json.loads(self.rfile.read(length) or b"{}") if length else {}
                fake.requests.append((self.command, self.path, body, dict(self.headers)))
                status, answer = handler(self.command, self.path, body)
                data = answer.encode() if isinstance(answer, str) else json.dumps(answer).encode()
                self.send_response(status)
                self.send_header("content-type", "application/json")
                self.send_header("content-length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            do_GET = do_POST = _serve

            def log_message(self, *args: object) -> None:
                pass

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), H)
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}"
        self.thread = threading.Thread(target=self.httpd.serve_forever, daemon=True)

    def __enter__(self) -> "FakeEngine":
        self.thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()


def generate_answer(tokens: list[int], logprobs: list[float], finish: str = "stop", spans=None) -> dict:
    return {
        "choices": [
            {
                "index": 0,
                "finish_reason": finish,
                "token_ids": tokens,
                "logprobs": {"content": [{"token_id": t, "logprob": lp} for t, lp in zip(tokens, logprobs)]},
                "weight_versions": spans if spans is not None else [{"version": "3", "start": 0, "end": len(tokens)}],
            }
        ],
        "usage": {"prompt_tokens": 3, "completion_tokens": len(tokens)},
    }


def test_generate_sends_tokens_params_and_session_header():
    with FakeEngine(lambda m, p, b: (200, generate_answer([5, 2], [-0.5, -0.1]))) as fake:

        async def call():
            async with EngineClient(fake.url, "e0") as client:
                return await client.generate([1, 4, 5], {"max_tokens": 2}, session_id="run-0-1")

        answer = asyncio.run(call())
    method, path, body, headers = fake.requests[0]
    assert (method, path) == ("POST", "/inference/v1/generate")
    assert body == {"token_ids": [1, 4, 5], "sampling_params": {"max_tokens": 2}}
    assert headers.get("X-Session-ID") == "run-0-1"
    assert answer["choices"][0]["token_ids"] == [5, 2]
    assert answer[ANSWERED_BY] == f"e0 at {fake.url}"  # so a problem in the answer can name the engine


def test_engine_error_names_engine_endpoint_status_and_body():
    body = "x" * 2000
    with FakeEngine(lambda m, p, b: (503, body)) as fake:
        with pytest.raises(EngineError) as err:
            SyncEngineClient(fake.url, "engine-7").pause("keep")
    e = err.value
    assert (e.engine, e.endpoint, e.status) == ("engine-7", "POST /pause", 503)
    assert len(e.body) == 500 and "engine-7" in str(e) and "HTTP 503" in str(e)


def test_control_calls_reach_the_right_endpoints():
    def handler(method, path, body):
        answers = {
            "/is_paused": {"is_paused": True},
            "/weight_info": {"weight_version": "12"},
            "/version": {"version": "0.32.0"},
            "/abort_requests": {"status": "aborted", "aborted": 3},
            "/get_world_size?include_dp=false": {"world_size": 2},
        }
        return 200, answers.get(path, {"ok": True})

    with FakeEngine(handler) as fake:
        c = SyncEngineClient(fake.url)
        c.pause("keep")
        c.resume()
        assert c.is_paused() is True
        assert c.weight_version() == 12
        assert c.abort_requests() == 3
        assert c.world_size() == 2
        c.sleep(2)
        c.wake_up(["kv", "weights"])
        c.init_weight_transfer({"a": 1})
        c.start_weight_update()
        c.update_weights({"names": ["w"]})
        c.finish_weight_update(4)
        c.update_weight_version(5)
        c.collective_rpc("reload_weights", {"weights_path": "/x"})
    seen = [(m, p, b) for m, p, b, _ in fake.requests]
    assert ("POST", "/pause?mode=keep", {}) in seen
    assert ("POST", "/sleep?level=2&mode=keep", {}) in seen
    assert ("POST", "/wake_up?tags=weights&tags=kv_cache", {}) in seen
    assert ("POST", "/init_weight_transfer_engine", {"init_info": {"a": 1}}) in seen
    assert ("POST", "/update_weights", {"update_info": {"names": ["w"]}}) in seen
    assert ("POST", "/finish_weight_update", {"weight_version": "4"}) in seen
    assert ("POST", "/update_weight_version", {"new_version": "5"}) in seen
    assert (
        "POST",
        "/collective_rpc",
        {"method": "reload_weights", "kwargs": {"weights_path": "/x"}, "args": []},
    ) in seen


def test_a_session_left_open_by_a_dead_publisher_is_closed_before_a_new_one():
    """A trainer killed mid-publish leaves the engine's update session open and vLLM refuses every
    later /start_weight_update (found by bench/bench_faults.py: the run could not go on). The
    client closes the stale session with no weights and opens its own; other errors still raise."""
    opened = []

    def handler(method, path, body):
        if path == "/start_weight_update":
            if opened:
                return 500, {
                    "error": {
                        "message": "Call to collective_rpc method failed: Worker failed with error "
                        "'start_weight_update called while a weight update is already "
                        "active. Call finish_weight_update first.'"
                    }
                }
            opened.append(True)
        if path == "/finish_weight_update":
            opened.clear()
        return 200, {"ok": True}

    with FakeEngine(handler) as fake:
        c = SyncEngineClient(fake.url, "engine-0")
        c.start_weight_update()  # the publish that dies before it finishes
        c.start_weight_update()  # the next publish
        calls = [(m, p, b) for m, p, b, _ in fake.requests]
    assert calls == [
        ("POST", "/start_weight_update", {}),
        ("POST", "/start_weight_update", {}),
        ("POST", "/finish_weight_update", {}),
        ("POST", "/start_weight_update", {}),
    ]

    with FakeEngine(lambda m, p, b: (500, {"error": {"message": "no weight transfer engine"}})) as fake:
        with pytest.raises(EngineError, match="no weight transfer engine"):
            SyncEngineClient(fake.url, "engine-0").start_weight_update()
        assert len(fake.requests) == 1


def test_vllm_026_versions_live_in_the_workers():
    """vLLM 0.26 has no /weight_info or versioned finish: the version goes to and comes from
    vime's worker extension over /collective_rpc (engines/vllm_api.py)."""
    stored: dict = {}

    def handler(method, path, body):
        if path == "/version":
            return 200, {"version": "0.26.0"}
        if path == "/collective_rpc" and body["method"] == "vime_set_weight_version":
            stored["v"] = body["kwargs"]["version"]
            return 200, {"results": [None, None]}
        if path == "/collective_rpc" and body["method"] == "vime_weight_version":
            return 200, {"results": [stored.get("v"), stored.get("v")]}
        if path in ("/weight_info", "/update_weight_version"):
            return 404, "not here in 0.26"
        return 200, {"ok": True}

    with FakeEngine(handler) as fake:
        c = SyncEngineClient(fake.url)
        assert c.weight_version() == 0  # a fresh engine: the checkpoint's weights
        c.finish_weight_update(7)
        assert c.weight_version() == 7
        c.update_weight_version(8)
        assert c.weight_version() == 8
    seen = [(m, p, b) for m, p, b, _ in fake.requests]
    assert ("POST", "/finish_weight_update", {}) in seen
    assert not any(p in ("/weight_info", "/update_weight_version") for _, p, _ in seen)


def test_vllm_api_by_release():
    from vime_core.engines.vllm_api import VllmApi, parse_release

    old, new = VllmApi.for_version("0.26.0"), VllmApi.for_version("0.32.0+cpu")
    assert (old.scale_out_flag, old.server_versions, old.ipc_packed_in_update) == (False, False, True)
    assert (new.scale_out_flag, new.server_versions, new.ipc_packed_in_update) == (True, True, False)
    assert parse_release("0.27.0rc1.dev3") == (0, 27)
    with pytest.raises(ValueError, match="not of the form"):
        parse_release("main")


def test_sleep_and_wake_skip_without_platform_support():
    with FakeEngine(lambda m, p, b: (500, "must not be called")) as fake:
        c = SyncEngineClient(fake.url, supports_sleep=False)
        assert c.sleep(1)["status"] == "skipped"
        assert c.wake_up(["weights"]) == {"status": "skipped", "tags": ["weights"]}
        assert c.is_sleeping() is False
    assert fake.requests == []


class WakeableServer:
    """What the RolloutManager's wake calls and the health monitor need of an engine server: the
    fake engine at `url` answers; `restart` counts and makes a failing wake succeed."""

    def __init__(self, url: str, fail_restart: bool = False) -> None:
        self.url, self.attach_url, self.fail_restart = url, None, fail_restart
        self.restarts = 0
        self.wake_fails = False
        self.wake_answer = "Call to wake_up method failed: CUDA Error: out of memory at cumem_allocator.cpp:163"

    def is_alive(self) -> bool:
        return True  # the engine answers: only a condemnation restarts it

    def process_exited(self) -> bool:
        return False

    def restart(self) -> str:
        if self.fail_restart:
            raise RuntimeError(
                "engine-1: vllm_gpu_memory_utilization=0.5 asks for 50% of each device, but device 0: 1.0 GiB free"
            )
        self.restarts += 1
        self.wake_fails = False
        return self.url

    def memory(self) -> dict:
        return {}


def _wake_handler(server: WakeableServer, asleep: bool):
    def handle(method: str, path: str, body: dict):
        if path == "/is_sleeping":
            return 200, {"is_sleeping": asleep}
        if path.startswith("/wake_up") and server.wake_fails:
            return 500, {
                "error": {"message": server.wake_answer, "type": "InternalServerError", "code": 500}
            }  # vLLM 0.26's answer
        return 200, {}

    return handle


def _fleet(servers: list[WakeableServer], restarted: list) -> object:
    """An EngineFleet reduced to what its wake calls and check_engines use: the engines'
    clients, the health monitor (paused: the engines slept) and the loop."""
    from vime_core.engines.fleet import EngineFleet
    from vime_core.utils.loop_thread import LoopThread

    fleet = EngineFleet.__new__(EngineFleet)
    fleet.servers = servers
    fleet.clients = [EngineClient(s.url, name=f"engine-{i}") for i, s in enumerate(servers)]
    fleet.loop = LoopThread("test-wake")
    fleet.health = HealthMonitor(servers, on_restarted=lambda i, url: restarted.append((i, url)))
    fleet.health.pause()
    return fleet


def _wakes(fake) -> list[str]:
    return [p for m, p, _, _ in fake.requests if p.startswith("/wake_up")]


def test_only_engines_left_asleep_wake_their_weights():
    """What bootstrap does after an iteration stopped while engines slept: the asleep engine
    (here the second) wakes its weights, not its KV cache; the awake one gets no wake call."""
    servers = [WakeableServer(""), WakeableServer("")]
    with FakeEngine(_wake_handler(servers[0], False)) as awake, FakeEngine(_wake_handler(servers[1], True)) as asleep:
        servers[0].url, servers[1].url = awake.url, asleep.url
        fleet = _fleet(servers, [])
        try:
            assert fleet.wake_asleep_engines() == ["engine-1"]
        finally:
            fleet.loop.close()
    assert [(m, p) for m, p, _, _ in awake.requests] == [("GET", "/is_sleeping")]
    assert [(m, p) for m, p, _, _ in asleep.requests] == [("GET", "/is_sleeping"), ("POST", "/wake_up?tags=weights")]


def test_an_engine_that_fails_to_wake_is_restarted_before_it_is_woken_again():
    """vLLM maps a sleeping engine's memory back allocation by allocation; a wake that ran out of
    memory part-way leaves it unable to wake (a second wake maps everything again). The other
    engine still wakes; the failed one gets no second wake call (the task's retries fail at once);
    bootstrap's check restarts it while the engines sleep, weights first, and then it wakes."""
    restarted: list = []
    servers = [WakeableServer(""), WakeableServer("")]
    servers[1].wake_fails = True
    with FakeEngine(_wake_handler(servers[0], True)) as good, FakeEngine(_wake_handler(servers[1], True)) as bad:
        servers[0].url, servers[1].url = good.url, bad.url
        fleet = _fleet(servers, restarted)
        try:
            with pytest.raises(EngineWakeError) as err:
                fleet.onload_weights()
            assert (err.value.engine, err.value.status, err.value.tags) == ("engine-1", 500, ["weights"])
            assert "out of memory" in str(err.value) and "restarted" in str(err.value)
            assert str(err.value).count("engine-1") == 1  # the engine's answer, not its client's message again
            assert _wakes(good) == ["/wake_up?tags=weights"] and _wakes(bad) == ["/wake_up?tags=weights"]
            assert "out of memory" in fleet.health.condemned(1) and fleet.health.condemned(0) is None

            with pytest.raises(EngineWakeError, match="engine-1"):
                fleet.onload_weights()  # a retry of the task: no call reaches either engine
            assert len(_wakes(good)) == 1 and len(_wakes(bad)) == 1

            assert fleet.health.check_now() == 0  # the monitor's own passes wait while engines sleep
            assert fleet.check_engines() == 1  # bootstrap's pass does not
            assert servers[1].restarts == 1 and servers[0].restarts == 0 and restarted == [(1, bad.url)]
            assert fleet.health.condemned_engines() == {}
            fleet.onload_weights()
            assert len(_wakes(good)) == 2 and len(_wakes(bad)) == 2
        finally:
            fleet.loop.close()


def test_an_engine_that_cannot_be_restarted_stops_bootstrap_naming_why():
    """The restart's own error reaches the message although the wake's answer fills the excerpt
    an EngineError keeps (a long vLLM answer could cut the restart's error off)."""
    servers = [WakeableServer("", fail_restart=True)]
    servers[0].wake_fails = True
    servers[0].wake_answer = "Call to wake_up method failed: CUDA Error: out of memory " + "x" * BODY_EXCERPT_CHARS
    with FakeEngine(_wake_handler(servers[0], True)) as bad:
        servers[0].url = bad.url
        fleet = _fleet(servers, [])
        try:
            with pytest.raises(EngineWakeError):
                fleet.onload_kv()
            with pytest.raises(EngineError) as err:
                fleet.check_engines()
            assert err.value.engine == "engine-0" and err.value.endpoint == "restart"
            assert "out of memory" in str(err.value) and "0.5 asks for 50%" in str(err.value)
            assert fleet.health.condemned(0) is not None  # the next bootstrap tries again
        finally:
            fleet.loop.close()


def test_wake_tags_and_versions_are_normalised():
    assert normalize_wake_tags(None) == ["weights", "kv_cache"]
    assert normalize_wake_tags(["kv", "weight", "kv_cache"]) == ["weights", "kv_cache"]
    assert normalize_wake_tags("kv") == ["kv_cache"]
    with pytest.raises(ValueError, match="tag 'gpu'"):
        normalize_wake_tags(["gpu"])
    assert parse_weight_version("default") == 0 and parse_weight_version("7") == 7
    with pytest.raises(ValueError, match="'v7'"):
        parse_weight_version("v7")


def test_reset_prefix_cache_retries_then_gives_up():
    refusals = {"left": 2}

    def handler(method, path, body):
        if refusals["left"] > 0:
            refusals["left"] -= 1
            return 200, {"success": False}
        return 200, {"success": True}

    with FakeEngine(handler) as fake:
        SyncEngineClient(fake.url).reset_prefix_cache(attempts=5, backoff_s=0.001)
        assert len(fake.requests) == 3
    with FakeEngine(lambda m, p, b: (200, {"success": False})) as fake:
        with pytest.raises(EngineError, match="still refused after 4 attempts"):
            SyncEngineClient(fake.url).reset_prefix_cache(attempts=4, backoff_s=0.001)
        assert len(fake.requests) == 4


def test_malformed_response_fails_the_sample_with_its_reason(tiny_model_dir):
    """A 200 answer with 3 tokens but 2 log-probs (asked for): the sample fails, naming the mismatch."""
    from vime_core.config import make_config
    from vime_core.demo.settings import demo_values
    from vime_core.data.sample import Sample, Status
    from vime_core.rollout.generate import GenerateContext, generate_sample

    broken = generate_answer([5, 6, 2], [-0.5, -0.1, -0.2])
    broken["choices"][0]["logprobs"]["content"].pop()
    cfg = make_config(demo_values({"hf_checkpoint": str(tiny_model_dir), "rollout_max_response_len": 8}))
    with FakeEngine(lambda m, p, b: (200, broken)) as fake:
        sample = Sample(tokens=[1, 4, 5], prompt_length=3)

        async def go():
            async with EngineClient(fake.url) as client:
                return await generate_sample(
                    GenerateContext(cfg, client, tokenizer=None), sample, {"temperature": 1.0, "logprobs": 0}
                )

        asyncio.run(go())
    assert sample.status is Status.FAILED
    assert "3 tokens but 2 log-probs" in sample.metadata["generate_error"]
    assert sample.response_length == 0 and sample.tokens == [1, 4, 5]


def test_policy_router_consistent_hash_is_sticky_and_moves_little():
    from vime_core.engines.router import PolicyRouter

    clients = [EngineClient(f"http://127.0.0.1:{9000 + i}") for i in range(3)]
    router = PolicyRouter(clients, "consistent_hash")
    sessions = [f"run-{g}-{i}" for g in range(100) for i in range(4)]
    first = {s: router.pick(s).base_url for s in sessions}
    assert first == {s: router.pick(s).base_url for s in sessions}
    counts = {c.base_url: list(first.values()).count(c.base_url) for c in clients}
    assert min(counts.values()) > len(sessions) / 3 / 2, counts  # roughly even
    router.remove(clients[2].base_url)
    moved = [s for s in sessions if router.pick(s).base_url != first[s]]
    # Only the removed engine's sessions move.
    assert set(moved) == {s for s in sessions if first[s] == clients[2].base_url}
    rr = PolicyRouter(clients[:2], "round_robin")
    assert [rr.pick().base_url for _ in range(4)] == [c.base_url for c in clients[:2]] * 2


def _fake_python(tmp_path: Path, script: str) -> str:
    path = tmp_path / "fake-python"
    path.write_text("#!/bin/sh\n" + script)
    path.chmod(0o755)
    return str(path)


@pytest.mark.integration  # starts server processes (stand-ins, or the vLLM environment's interpreter)
def test_engine_server_start_failure_shows_log_tail(tmp_path, tiny_model_dir):
    from vime_core.config import make_config
    from vime_core.demo.settings import demo_values
    from vime_core.engines.server import EngineServer, EngineStartError

    python = _fake_python(
        tmp_path, 'for i in $(seq 1 60); do echo "line $i"; done; echo "CUDA out of memory" >&2; exit 3\n'
    )
    cfg = make_config(
        demo_values({"hf_checkpoint": str(tiny_model_dir), "vllm_python": python, "engine_startup_timeout_s": 30})
    )
    server = EngineServer(cfg, log_dir=str(tmp_path))
    with pytest.raises(EngineStartError) as err:
        server.start()
    message = str(err.value)
    assert "exited with code 3" in message and "CUDA out of memory" in message
    assert "line 60" in message and "line 19\n" not in message  # the last 40 lines only
    server.shutdown()


@pytest.mark.integration  # starts server processes (stand-ins, or the vLLM environment's interpreter)
def test_engine_server_times_out_and_kills_a_silent_server(tmp_path, tiny_model_dir):
    from vime_core.config import make_config
    from vime_core.demo.settings import demo_values
    from vime_core.engines.server import EngineServer, EngineStartError

    # silent once launched; vime's question for vLLM's version (no --port) is refused at once
    python = _fake_python(tmp_path, 'case " $* " in *" --port "*) echo starting; exec sleep 600;; esac; exit 1\n')
    cfg = make_config(
        demo_values({"hf_checkpoint": str(tiny_model_dir), "vllm_python": python, "engine_startup_timeout_s": 2})
    )
    server = EngineServer(cfg, log_dir=str(tmp_path))
    with pytest.raises(EngineStartError, match="not healthy after engine_startup_timeout_s=2"):
        server.start()
    assert server._proc is None  # terminated, not left behind


# A stand-in server: exits as vLLM does when its port was taken (the first `taken` launches), then
# answers every GET with 200 on the port it was given.
_PORT_TAKEN_THEN_SERVE = """
port=""; prev=""
for a in "$@"; do [ "$prev" = "--port" ] && port=$a; prev=$a; done
[ -n "$port" ] || exit 1  # not a server launch (vime asks the interpreter for vLLM's version)
echo "$port" >> {launches}
if [ "$(wc -l < {launches})" -le {taken} ]; then echo "OSError: [Errno 98] Address already in use"; exit 1; fi
exec {python} -c "
import http.server, sys
class H(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        self.send_response(200); self.end_headers(); self.wfile.write(b'{{}}')
    def log_message(self, *a): pass
http.server.HTTPServer(('127.0.0.1', int(sys.argv[1])), H).serve_forever()
" "$port"
"""


@pytest.mark.integration  # starts server processes (stand-ins)
@pytest.mark.parametrize("taken", [1, 3])
def test_a_server_whose_port_was_taken_launches_again_on_another(tmp_path, tiny_model_dir, taken):
    from vime_core.config import make_config
    from vime_core.demo.settings import demo_values
    from vime_core.engines.server import PORT_ATTEMPTS, EngineServer, EngineStartError

    launches = tmp_path / "launches"
    python = _fake_python(
        tmp_path, _PORT_TAKEN_THEN_SERVE.format(launches=launches, taken=taken, python=sys.executable)
    )
    cfg = make_config(
        demo_values({"hf_checkpoint": str(tiny_model_dir), "vllm_python": python, "engine_startup_timeout_s": 30})
    )
    server = EngineServer(cfg, log_dir=str(tmp_path), warmup=False)
    try:
        if taken < PORT_ATTEMPTS:
            url = server.start()
            ports = [int(line) for line in launches.read_text().split()]
            assert len(ports) == taken + 1 and len(set(ports)) == len(ports)  # a new port each time
            assert url.endswith(f":{ports[-1]}") and server.is_alive()
        else:  # every attempt lost its port: the last one's failure, after PORT_ATTEMPTS launches
            with pytest.raises(EngineStartError, match="Address already in use"):
                server.start()
            assert len(launches.read_text().split()) == PORT_ATTEMPTS
    finally:
        server.shutdown()


@pytest.mark.integration  # starts server processes (stand-ins, or the vLLM environment's interpreter)
def test_engine_server_command_and_environment(tiny_model_dir):
    from vime_core.config import make_config
    from vime_core.demo.settings import demo_values
    from vime_core.engines.server import EngineServer, cpu_bind, cpu_sets

    cfg = make_config(
        demo_values(
            {
                "hf_checkpoint": str(tiny_model_dir),
                "rollout_max_context_len": 96,
                "offload_rollout": True,
                "vllm_cpu_kvcache_gb": 1.5,
                "actor_num_gpus_per_node": 2,
                "vllm_extra_args": ["--max-num-seqs", "64"],
            }
        )
    )
    server = EngineServer(cfg, 1, weight_transfer_config={"backend": "nccl"})
    cmd = server.command(4321)
    joined = " ".join(cmd)
    assert "--host 127.0.0.1 --port 4321" in joined and "--max-model-len 96" in joined
    assert "--logprobs-mode processed_logprobs" in joined and "--enable-scale-out" in joined
    assert "--enable-sleep-mode" not in cmd  # CPU: no sleep mode
    assert "--weight-transfer-config" not in cmd  # nccl needs CUDA
    assert cmd[-2:] == ["--max-num-seqs", "64"]
    assert "--disable-log-stats" in cmd  # vllm_log_stats off by default
    logging_stats = EngineServer(make_config({**cfg.model_dump(), "vllm_log_stats": True}), 1).command(4321)
    assert "--disable-log-stats" not in logging_stats
    env = server.environment()
    assert env["VLLM_SERVER_DEV_MODE"] == "1" and env["VLLM_CPU_KVCACHE_SPACE"] == "2"
    assert env["VLLM_CPU_OMP_THREADS_BIND"] == cpu_bind(1, 2)
    assert env["PYTHONPATH"].split(":")[0] == str(Path(__file__).resolve().parents[2])
    # Triton's kernels in one folder under vLLM's cache root, whatever its compile cache answers; a
    # folder the user names wins
    from vime_core.engines.vllm_cache import cache_root

    assert env["TRITON_CACHE_DIR"] == str(cache_root(env) / "triton_cache")
    named = make_config({**cfg.model_dump(), "vllm_env": ["TRITON_CACHE_DIR=/scratch/triton"]})
    assert EngineServer(named, 1).environment()["TRITON_CACHE_DIR"] == "/scratch/triton"
    assert cpu_bind(0, 2, cores=[0, 1]) == "0" and cpu_bind(1, 2, cores=[0, 1]) == "1"
    assert cpu_bind(0, 1, cores=[0, 1, 2, 3]) == "0-3" and cpu_bind(1, 1, 2, cores=[0, 1, 2, 3]) == "0-1|2-3"
    # a one-rank CPU engine is one engine-core process pinned to its cores, with a thread per core
    assert server.cpu_cores() == cpu_sets(1, 2)[0]
    assert cmd[cmd.index("--distributed-executor-backend") + 1] == "uni"
    assert cmd[1:3] == ["-m", "vime_core.engines.vllm_side.api_server"]  # its engine core forked
    assert env["VLLM_ENABLE_V1_MULTIPROCESSING"] == "0" and env["OMP_NUM_THREADS"] == str(len(server.cpu_cores()))
    two_ranks = EngineServer(cfg, 1, server_args={"tensor_parallel_size": 2})
    assert two_ranks.cpu_cores() is None and "--distributed-executor-backend" not in two_ranks.command(4321)
    assert "VLLM_ENABLE_V1_MULTIPROCESSING" not in two_ranks.environment()
    two_processes = EngineServer(make_config({**cfg.model_dump(), "vllm_cpu_single_process": False}), 1)
    assert two_processes.cpu_cores() is None and "--distributed-executor-backend" not in two_processes.command(4321)
    for spawned in (two_ranks.command(4321), two_processes.command(4321)):  # vLLM's own server module
        assert spawned[1:3] == ["-m", "vllm.entrypoints.openai.api_server"]


def test_attaching_to_an_unreachable_engine_fails_fast(tiny_model_dir):
    import time

    from vime_core.config import make_config
    from vime_core.demo.settings import demo_values
    from vime_core.engines.server import EngineServer, EngineStartError, free_port

    url = f"http://127.0.0.1:{free_port()}"
    cfg = make_config(demo_values({"hf_checkpoint": str(tiny_model_dir), "engine_urls": [url]}))
    t0 = time.monotonic()
    with pytest.raises(EngineStartError, match=r"engine_urls\[0\]=http://127.0.0.1:\d+ does not answer /health"):
        EngineServer(cfg, 0, attach_url=url).start()
    assert time.monotonic() - t0 < 15


def test_sync_client_has_every_async_call_with_its_signature_and_doc():
    import inspect

    public = {
        name
        for name, fn in vars(EngineClient).items()
        if not name.startswith("_") and name != "aclose" and inspect.iscoroutinefunction(fn)
    }
    generated = {name for name in vars(SyncEngineClient) if not name.startswith("_")}
    assert generated == public
    for name in public:
        blocking, original = getattr(SyncEngineClient, name), getattr(EngineClient, name)
        assert inspect.signature(blocking) == inspect.signature(original) and blocking.__doc__ == original.__doc__
        assert not inspect.iscoroutinefunction(blocking)
    with pytest.raises(AttributeError):
        SyncEngineClient("http://127.0.0.1:1").aclose
