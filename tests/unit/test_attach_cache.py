"""Phase tasks reuse the run's actor handles instead of a GCS lookup per actor per task."""

from __future__ import annotations


def test_attach_reuses_handles_until_forgotten(monkeypatch):
    import ray

    from vime_core.cluster import run_actors
    from vime_core.config import VimeConfig

    lookups: list[str] = []
    monkeypatch.setattr(run_actors, "_get_actor", lambda name, run: lookups.append(name) or f"{run}/{name}")
    job = {"id": "01000000"}

    class Context:
        def get_job_id(self):
            return job["id"]

    monkeypatch.setattr(ray, "get_runtime_context", lambda: Context())
    cfg = VimeConfig(run_name="cache-test")
    cache = run_actors.AttachedHandles()
    manager, group = run_actors.attach(cfg, cache)
    per_attach = len(lookups)
    assert per_attach == 1 + len(group.actors)
    again, group2 = run_actors.attach(cfg, cache)
    assert (again, group2.actors) == (manager, group.actors) and len(lookups) == per_attach
    run_actors.attach(cfg, cache, reuse=False)  # a retried task: looked up again
    assert len(lookups) == 2 * per_attach
    run_actors.attach(cfg)  # no cache: always looked up
    assert len(lookups) == 3 * per_attach
    job["id"] = "02000000"  # another Ray session (a new cluster): nothing reused
    run_actors.attach(cfg, cache)
    assert len(lookups) == 4 * per_attach
    cache.forget("cache-test")  # bootstrap and teardown forget the run's handles
    job["id"] = "01000000"
    run_actors.attach(cfg, cache)
    assert len(lookups) == 5 * per_attach
