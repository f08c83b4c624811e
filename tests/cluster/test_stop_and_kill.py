"""registry.stop_and_kill without a Ray cluster (ray.wait and ray.kill stand-ins): every rank's
orderly stop (the KV tiers' flush) is asked before any kill, with the timeout; a rank that does
not answer, or a stop that fails, still ends in the kill."""

import pytest

from cluster import registry


class FakeActor:
    def __init__(self, name: str, log: list) -> None:
        self.name, self.log = name, log
        self.stop = self  # actor.stop.remote(...)

    def remote(self, timeout_s: float) -> str:
        self.log.append(("stop", self.name, timeout_s))
        return f"ref-{self.name}"


@pytest.mark.parametrize("wait", ["all", "late", "raises"])
def test_every_rank_is_stopped_before_it_is_killed(monkeypatch, wait):
    log: list = []

    def fake_wait(refs, num_returns, timeout):
        log.append(("wait", tuple(refs), num_returns, timeout))
        if wait == "raises":
            raise RuntimeError("an actor died")
        return (refs, []) if wait == "all" else (refs[:1], refs[1:])

    monkeypatch.setattr(registry.ray, "wait", fake_wait)
    monkeypatch.setattr(registry.ray, "kill", lambda a, no_restart: log.append(("kill", a.name)))
    actors = [FakeActor("p0", log), FakeActor("p1", log)]
    registry.stop_and_kill(actors, "prefill", timeout_s=3.0)
    assert log == [
        ("stop", "p0", 3.0),
        ("stop", "p1", 3.0),
        ("wait", ("ref-p0", "ref-p1"), 2, 3.0 + registry.STOP_GRACE_S),
        ("kill", "p0"),
        ("kill", "p1"),
    ]
