"""lora_publish=adapter on the rollout side: which model a request names for a weight version,
the span a response of a named adapter records, and the fleet's clients naming the version a
publish ended with (`EngineFleet.serve_version`)."""

from __future__ import annotations

from types import SimpleNamespace

from vime_core.data.sample import WeightSpan
from vime_core.engines.adapters import adapter_name, served_name
from vime_core.engines.client import ASKED_MODEL, EngineClient
from vime_core.engines.fleet import EngineFleet
from vime_core.engines.router import PolicyRouter
from vime_core.rollout.generate import parse_choice

ADAPTERS = SimpleNamespace(lora_publish="adapter", lora_rank=8)
MERGED = SimpleNamespace(lora_publish="merged", lora_rank=8)


def _answer(tokens: list[int], engine_version: int, model: str | None) -> dict:
    choice = {
        "token_ids": tokens,
        "finish_reason": "stop",
        "weight_versions": [{"version": str(engine_version), "start": 0, "end": len(tokens)}],
    }
    return {"choices": [choice], **({ASKED_MODEL: model} if model else {})}


def test_requests_name_the_adapter_of_a_published_version_only_in_adapter_mode():
    assert served_name(ADAPTERS, 3) == adapter_name(3) == "vime-lora-v3"
    assert served_name(ADAPTERS, 0) is None  # nothing published yet: the base weights
    assert served_name(MERGED, 3) is None


def test_a_named_adapter_response_records_the_adapters_version_over_the_engines():
    # the engine moved to v5 while the request, admitted with adapter v4, ran on v4's adapter
    _, _, _, _, spans = parse_choice(_answer([7, 8, 9], 5, adapter_name(4)), with_log_probs=False)
    assert spans == [WeightSpan(4, 0, 3)]
    _, _, _, _, spans = parse_choice(_answer([7, 8], 5, None), with_log_probs=False)
    assert spans == [WeightSpan(5, 0, 2)]  # no adapter named: the engine's spans
    _, _, _, _, spans = parse_choice(_answer([], 5, adapter_name(4)), with_log_probs=False)
    assert spans == []


def test_serve_version_names_the_adapter_on_every_client():
    fleet = EngineFleet.__new__(EngineFleet)  # only the clients: no engines, no loop
    clients = [EngineClient(f"http://127.0.0.1:{8000 + i}", f"engine-{i}") for i in range(2)]
    fleet.cfg, fleet.clients, fleet.served_model = ADAPTERS, clients, None
    fleet.generator = PolicyRouter(clients, "round_robin")
    fleet.serve_version(2)
    assert [c.model for c in clients] == [adapter_name(2)] * 2
    fleet.serve_version(3)
    assert fleet.served_model == adapter_name(3) and [c.model for c in clients] == [adapter_name(3)] * 2
    fleet.cfg = MERGED
    fleet.serve_version(4)
    assert [c.model for c in clients] == [None, None]


def test_a_missing_adapter_is_retried_another_missing_model_is_not():
    from vime_core.engines.client import EngineError
    from vime_core.rollout.generate import _no_answer

    missing = '{"error":{"message":"The model `vime-lora-v2` does not exist.","code":404}}'
    assert _no_answer(EngineError("engine-0", "POST /inference/v1/generate", 404, missing))
    assert not _no_answer(EngineError("engine-0", "POST /inference/v1/generate", 404, "The model `x` does not exist"))
    assert not _no_answer(EngineError("engine-0", "POST /inference/v1/generate", 400, "bad request"))


def test_with_adapters_and_the_weight_check_no_rollout_is_prefetched():
    from vime_core.config.loader import make_config
    from vime_core.step_plan import plan_step

    def cfg(**kw):
        return make_config({"run_name": "p", "num_rollout": 4, "device": "cpu", "rollout_prefetch": True, **kw})

    lora = {"lora_rank": 4, "lora_publish": "adapter"}
    assert plan_step(cfg(**lora), 0).prefetch(False)
    assert plan_step(cfg(check_weight_update_equal=True), 0).prefetch(False)
    assert not plan_step(cfg(check_weight_update_equal=True, **lora), 0).prefetch(False)
