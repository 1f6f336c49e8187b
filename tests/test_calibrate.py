"""talaria_jax.calibrate's staging measurement on a fake engine and slot (a fake clock: no timing
noise), the slowdown fit, and the profile round trip through to_yaml."""
import collections
import dataclasses

import pytest

from talaria_jax import calibrate
from talaria_jax.sim.hardware import load_hardware


class FakeSlot:
    """A staging copy arrives after `copy_steps` readiness checks (one per step)."""

    def __init__(self, copy_steps=3):
        self.copy_steps, self.staged, self.left, self.stages = copy_steps, None, 0, []

    def stage(self, host):
        self.staged, self.left = host, self.copy_steps
        self.stages.append(host)

    def staged_ready(self):
        self.left -= 1
        return self.staged is not None and self.left <= 0

    def in_flight(self):
        return self.staged is not None and self.left > 0

    def drop_staged(self):
        self.staged = None


class FakeEngine:
    """Each step takes 1 s of the fake clock, `slowdown` s while the slot's copy is in flight."""

    def __init__(self, slot, clock, slowdown):
        self.slot, self.clock, self.slowdown = slot, clock, slowdown
        self.cfg = dataclasses.make_dataclass("Cfg", [("vocab_size", int)])(100)
        self.requests, self.waiting, self.running, self.allocator, self.aborted = {}, collections.deque(), [], None, []
        self.prefix_cache = None

    def add_request(self, prompt, params):
        seq = type("Seq", (), {"grow": lambda self, alloc, n: None})()
        req = type("Req", (), {"seq": seq, "num_computed": 0})()
        rid = f"r{len(self.requests)}"
        self.requests[rid] = req
        self.waiting.append(req)
        return rid

    def step(self):
        self.clock[0] += self.slowdown if self.slot.in_flight() else 1.0

    def abort(self, rid):
        self.running.remove(self.requests.pop(rid))
        self.aborted.append(rid)


@pytest.fixture
def clock(monkeypatch):
    c = [0.0]
    monkeypatch.setattr(calibrate.time, "perf_counter", lambda: c[0])
    return c


def test_decode_step_times_keeps_staging_in_flight(clock):
    slot = FakeSlot(copy_steps=3)
    eng = FakeEngine(slot, clock, slowdown=1.5)
    keep = calibrate.KeepStaging(slot, "model-b")
    idle, staging = calibrate.decode_step_times(eng, batch=2, context=8, steps=6, keep=keep)
    assert idle == [1.0] * 6
    # the copy is issued before the first staging step and re-issued once it has arrived
    assert keep.copies >= 2 and all(h == "model-b" for h in slot.stages)
    assert sum(s == 1.5 for s in staging) >= 4
    assert slot.staged is None and not eng.requests and len(eng.aborted) == 2  # settled and cleaned up
    idle, staging = calibrate.decode_step_times(eng, batch=2, context=8, steps=4)
    assert idle == [1.0] * 4 and staging == []


def test_staging_slowdown_fit():
    assert calibrate.staging_slowdown([]) == 1.0
    r = lambda idle, busy: {"step_idle_s": idle, "step_staging_s": busy}
    assert calibrate.staging_slowdown([r(0.01, 0.02), r(0.1, 0.15)]) == pytest.approx(1.75)
    assert calibrate.staging_slowdown([r(0.1, 0.09)]) == 1.0  # never below 1: a faster step is noise


def test_profile_round_trips_through_to_yaml(tmp_path):
    hw = dataclasses.replace(load_hardware("cpu"), staging_step_slowdown=1.8)
    p = tmp_path / "cpu2.yaml"
    p.write_text(calibrate.to_yaml(hw, "a header\nof two lines"))
    assert "staging_step_slowdown: 1.8" in p.read_text()
    assert load_hardware(p) == dataclasses.replace(hw, name="cpu")
