"""`vime train`'s early start (vime_core/cluster/early_start.py): the actors' start begun in a thread before
the first flow run, and claimed by bootstrap once; a start that could not begin or failed leaves
bootstrap to start them itself."""

import threading

import pytest

import tasks.bootstrap as boot
import vime_core.cluster.early_start as early
from vime_core.config.loader import make_config


@pytest.fixture
def cfg():
    return make_config({"run_name": "early", "device": "cpu"})


@pytest.fixture(autouse=True)
def _no_leftovers():
    yield
    early._EARLY.clear()


def test_the_early_start_runs_in_a_thread_and_is_claimed_once(monkeypatch, cfg):
    calls, started = [], threading.Event()

    def start_actors(config):
        calls.append((config.run_name, threading.current_thread().name))
        started.set()
        return "actors"

    monkeypatch.setattr(early, "ensure_ray", lambda address: None)
    monkeypatch.setattr(early, "start_actors", start_actors)
    assert early.start_early(cfg)
    assert started.wait(10)
    assert calls == [("early", calls[0][1])] and calls[0][1].startswith("vime-early-start")
    assert early.claim_early(cfg) == "actors"
    assert early.claim_early(cfg) is None  # a retried bootstrap starts or attaches on its own


def test_no_cluster_no_early_start(monkeypatch, cfg):
    def unreachable(address):
        raise RuntimeError("no Ray cluster at address 'auto'")

    monkeypatch.setattr(early, "ensure_ray", unreachable)
    assert early.start_early(cfg) is False
    assert early.claim_early(cfg) is None


def test_a_failed_early_start_leaves_the_start_to_bootstrap(monkeypatch, cfg, caplog):
    def start_actors(config):
        raise RuntimeError("placement group timed out")

    monkeypatch.setattr(early, "ensure_ray", lambda address: None)
    monkeypatch.setattr(early, "start_actors", start_actors)
    assert early.start_early(cfg)
    with caplog.at_level("WARNING", logger="vime.bootstrap"):
        assert early.claim_early(cfg) is None
    assert "placement group timed out" in caplog.text


def test_another_run_claims_nothing(monkeypatch, cfg):
    monkeypatch.setattr(early, "ensure_ray", lambda address: None)
    monkeypatch.setattr(early, "start_actors", lambda config: "actors")
    early.start_early(cfg)
    assert early.claim_early(cfg.model_copy(update={"run_name": "other"})) is None
    assert early.claim_early(cfg) == "actors"


def test_the_early_start_marks_its_begin_and_end_in_seconds_since_the_command():
    actors = early.RunActors("manager", "trainers", new_manager=True, created=True, init=None, seconds=8.5, began_s=3.0)
    assert early.early_marks(actors) == {"early_start": 3.0, "early_actors_created": 11.5}
    assert early.early_marks(None) == {}  # bootstrap started the actors itself


def test_startup_marks_move_bootstraps_marks_to_the_commands_clock():
    marks = boot.startup_marks(
        {"early_start": 3.0, "early_actors_created": 11.5},
        20.0,
        {"actors_created": 0.5, "started_early": 8.5, "engines_ready": 60.0},
    )
    # started_early is the early start's length, not a moment: it stays out
    assert marks == {
        "early_start": 3.0,
        "early_actors_created": 11.5,
        "bootstrap_started": 20.0,
        "actors_created": 20.5,
        "engines_ready": 80.0,
    }
    assert boot.startup_marks({}, 4.0, {"kv_onloaded": 1.0}) == {"bootstrap_started": 4.0, "kv_onloaded": 5.0}


def test_startup_marks_put_each_engines_milestones_on_the_commands_clock_in_order():
    engines = [
        {"launched_epoch": 1012.0, "marks_s": {"args": 20.0, "serving": 60.0}},
        {},  # attached: no launch of ours
        {"launched_epoch": 1005.0, "marks_s": {"serving": 50.0}},
    ]
    marks = boot.startup_marks({"early_start": 3.0}, 20.0, {"engines_ready": 60.0}, engines, command_epoch=1000.0)
    assert marks == {
        "early_start": 3.0,
        "engine2_launched": 5.0,
        "engine0_launched": 12.0,
        "bootstrap_started": 20.0,
        "engine0_args": 32.0,
        "engine2_serving": 55.0,
        "engine0_serving": 72.0,
        "engines_ready": 80.0,
    }
    assert list(marks) == sorted(marks, key=marks.get)  # in the order they happened


def test_startup_marks_put_the_managers_steps_between_the_engines_and_bootstraps():
    marks = boot.startup_marks(
        {},
        20.0,
        {"engines_ready": 60.0},
        [{"launched_epoch": 1005.0, "marks_s": {"serving": 50.0}}],
        {"engines_started": 1056.5, "router_ready": 1057.0, "ready": 1078.0},
        command_epoch=1000.0,
    )
    assert marks == {
        "bootstrap_started": 20.0,
        "engine0_launched": 5.0,
        "engine0_serving": 55.0,
        "manager_engines_started": 56.5,
        "manager_router_ready": 57.0,
        "manager_ready": 78.0,
        "engines_ready": 80.0,
    }
    assert list(marks) == sorted(marks, key=marks.get)


def test_vime_train_starts_early_with_the_resolved_configuration(monkeypatch, cfg):
    resolved = cfg.model_copy(update={"hf_checkpoint": "/resolved/model"})
    begun = []
    monkeypatch.setattr(early, "resolve_run_config", lambda config: resolved)
    monkeypatch.setattr(early, "start_early", lambda config: begun.append(config) or True)
    assert early.start_actors_early(cfg)
    assert begun == [resolved]


def test_a_configuration_that_does_not_resolve_is_left_to_the_flow(monkeypatch, cfg):
    def missing(config):
        raise FileNotFoundError("prompt_data='/nowhere.jsonl': no such file")

    monkeypatch.setattr(early, "resolve_run_config", missing)
    monkeypatch.setattr(early, "start_early", lambda config: pytest.fail("started without a resolved configuration"))
    assert early.start_actors_early(cfg) is False
