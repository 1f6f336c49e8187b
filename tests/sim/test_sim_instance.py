"""SimInstance memory accounting and eviction on hand-computable toys (talaria_jax.sim.toys: 30 GB of
HBM, 10 GB models, 1 MB of KV per token; pages of 1 MB here so tokens and pages coincide)."""
import dataclasses

import pytest

from talaria_jax.scheduler.api import WeightState
from talaria_jax.scheduler.session import Call
from talaria_jax.sim.instance import SimInstance
from talaria_jax.sim.toys import TOY_HW, TOY_SHAPES, toy_model


def _inst(models=("m1",), **kw):
    kw = {"host_kv": True, "staging": False, "drop_kv_on_switch": False, "page_bytes": 1_000_000, **kw}
    return SimInstance("i", TOY_HW, TOY_SHAPES, models, **kw)


def _run(inst, t=0.0):
    while (end := inst.start_chunk(t)) is not None:
        inst.finish_chunk(end)
        t = end
    return t


def _serve(inst, call, t):
    inst.admit(call)
    return _run(inst, t)


def test_waiting_continuation_pages_counted_once():
    # a finished 1000+100-token call leaves 1100 tokens (1100 pages) on device; its continuation
    # (1500 + 10 tokens) will need 1510 pages in all, not 1100 + 1510
    inst = _inst()
    inst.switch_model("m1")
    t = _serve(inst, Call("s", 0, "m1", 1000, 100, 0.0, 0.0), _run(inst))
    assert inst.kv_pages_used() == 0 and inst.cached_prefix("s", "m1").device_tokens == 1100
    inst.admit(Call("s", 1, "m1", 1500, 10, 0.0))
    assert inst.kv_pages_used() == 1510


def _two_models_and_idle_kv(host_kv):
    """m1 served session s (1100 tokens = 1.1 GB of KV, idle), then m2 became active: 21.1 GB of 30
    GB used, m1 resident but inactive. A switch to m3 (10 GB) must free 1.1 GB."""
    inst = _inst(("m1", "m2", "m3"), host_kv=host_kv)
    inst.switch_model("m1")
    t = _serve(inst, Call("s", 0, "m1", 1000, 100, 0.0, 0.0), _run(inst))
    inst.switch_model("m2")
    t = _run(inst, t)
    assert inst.weight_state("m1") == WeightState.RESIDENT and inst.cached_prefix("s", "m1").device_tokens == 1100
    inst.switch_model("m3")
    _run(inst, t)
    return inst


def test_eviction_keeps_kv_that_would_be_recomputed():
    # no host copy: dropping s's KV costs a 2.2 s recompute of 1.1 GB (2 ns/B), dropping m1's weights
    # a 1.0 s reload of 10 GB (0.1 ns/B): the weights go, the KV stays
    inst = _two_models_and_idle_kv(host_kv=False)
    assert inst.weight_state("m1") == WeightState.HOST
    assert inst.cached_prefix("s", "m1").device_tokens == 1100


def test_eviction_drops_host_backed_kv_before_weights():
    # with a host copy the KV restores at 10 GB/s (0.1 s for 1.1 GB): no dearer per byte than the
    # weights' reload, and less recently used, so the same rule drops the KV and keeps m1 resident
    inst = _two_models_and_idle_kv(host_kv=True)
    assert inst.weight_state("m1") == WeightState.RESIDENT
    assert inst.cached_prefix("s", "m1") == type(inst.cached_prefix("s", "m1"))(0, 1100)


def _staged_call_chunks(slowdown, stage=True):
    """m1 active at t=1 (a 1 s load); if `stage`, m2's 1 s staging copy (10 GB at 10 GB/s) starts
    then. A call (10-token prompt, 5 output tokens) is served from t=1: its prefill (0.1001 s of
    work) and 5 decode steps (0.10012 s each: 10 GB of weights + 12 MB of KV at 100 GB/s) as two chunks. Returns each chunk's (start, end)."""
    hw = dataclasses.replace(TOY_HW, staging_step_slowdown=slowdown)
    inst = SimInstance("i", hw, TOY_SHAPES, ("m1", "m2"), host_kv=True, staging=True, drop_kv_on_switch=False,
                       page_bytes=1_000_000)
    inst.switch_model("m1")
    t = _run(inst)
    assert t == pytest.approx(1.0)
    if stage:
        assert inst.stage_model("m2") and inst.weight_state("m2") == WeightState.STAGING
    inst.admit(Call("s", 0, "m1", 10, 5, 0.0, 0.0))
    chunks = []
    while (end := inst.start_chunk(t)) is not None:
        inst.finish_chunk(end)
        chunks.append((t, end))
        t = end
    return [x for c in chunks for x in c]


def test_steps_slow_down_while_staging_only():
    base = _staged_call_chunks(1.0)
    slow = _staged_call_chunks(2.0)
    p0, p1, d0, d1 = base
    prefill, decode = p1 - p0, d1 - d0
    assert prefill == pytest.approx(0.1001) and decode == pytest.approx(5 * 0.10012)
    # the prefill runs wholly inside the copy: 2x; the decode outlasts it (the copy arrives at t=2):
    # its first 2 - 1.2002 s run at half speed, the rest of its work at full speed
    q0, q1, e0, e1 = slow
    assert q1 - q0 == pytest.approx(2 * prefill)
    overlap = 2.0 - e0
    assert 0 < overlap < e1 - e0
    assert e1 - e0 == pytest.approx(overlap + decode - overlap / 2)
    assert e1 > d1 + 0.3
    # nothing staging: the factor changes nothing
    assert _staged_call_chunks(2.0, stage=False) == pytest.approx(_staged_call_chunks(1.0, stage=False))
    assert _staged_call_chunks(2.0, stage=False) == pytest.approx(base)


@pytest.mark.parametrize("on_device", [True, False])
def test_compacted_turn_reuses_only_its_prefix(on_device):
    # turn 0 leaves 1100 tokens of KV (device and host copy); turn 1 compacts: a 700-token prompt whose
    # first 300 tokens are the old prefix. Only those 300 come from cache (device, or restored from host
    # once the device copy is gone), the other 400 are prefilled, and the session then holds 710 tokens
    inst = _inst(("m1", "m2"), drop_kv_on_switch=True)
    inst.switch_model("m1")
    t = _serve(inst, Call("s", 0, "m1", 1000, 100, 0.0, 0.0), _run(inst))
    if not on_device:  # away to m2 and back: the switch (sleep mode) drops the device copy, not the host one
        for m in ("m2", "m1"):
            inst.switch_model(m)
            t = _run(inst, t)
    assert inst.cached_prefix("s", "m1") == type(inst.cached_prefix("s", "m1"))(1100 if on_device else 0, 1100)
    before = dataclasses.replace(inst.stats)
    _serve(inst, Call("s", 1, "m1", 700, 10, 0.0, prefix_tokens=300), t)
    st = inst.stats
    assert st.device_hit_tokens - before.device_hit_tokens == (300 if on_device else 0)
    assert st.restored_tokens - before.restored_tokens == (0 if on_device else 300)
    assert st.prefill_tokens - before.prefill_tokens == 400
    assert inst.cached_prefix("s", "m1") == type(inst.cached_prefix("s", "m1"))(710, 710)


def test_a_session_on_two_models_keeps_each_models_kv():
    # s calls m1 (1000 + 100), then m2 (1500 + 100), then m1 again (2000): m2's call neither drops
    # m1's device KV nor replaces its host copy, so the return to m1 hits its own 1100 tokens on device
    inst = _inst(("m1", "m2"))
    loc = type(inst.cached_prefix("s", "m1"))
    t = 0.0
    for k, (m, prompt) in enumerate((("m1", 1000), ("m2", 1500))):
        inst.switch_model(m)
        t = _serve(inst, Call("s", k, m, prompt, 100, 0.0, 0.0 if k == 0 else None), _run(inst, t))
    assert inst.cached_prefix("s", "m1") == loc(1100, 1100) and inst.cached_prefix("s", "m2") == loc(1600, 1600)
    inst.switch_model("m1")
    before = dataclasses.replace(inst.stats)
    _serve(inst, Call("s", 2, "m1", 2000, 10, 0.0), _run(inst, t))
    assert inst.stats.device_hit_tokens - before.device_hit_tokens == 1100
    assert inst.stats.prefill_tokens - before.prefill_tokens == 900
    assert inst.cached_prefix("s", "m2") == loc(1600, 1600)


def test_a_switch_to_a_model_that_does_not_fit_beside_the_staged_one_drops_it():
    # m1 (10 GB) active and m2 (16 GB) staging fill 26 of 30 GB; a switch to m3 (15 GB) cannot fit
    # beside m2 even with m1 evicted: the staging copy is given up (m2 back to host), not a crash
    shapes = {**TOY_SHAPES, "m2": toy_model("m2", 16.0), "m3": toy_model("m3", 15.0)}
    inst = SimInstance("i", TOY_HW, shapes, ("m1", "m2", "m3"), host_kv=True, staging=True,
                       drop_kv_on_switch=False, page_bytes=1_000_000)
    inst.switch_model("m1")
    t = _run(inst)
    assert inst.stage_model("m2") and inst.weight_state("m2") == WeightState.STAGING
    inst.switch_model("m3")
    _run(inst, t)
    assert inst.active_model() == "m3" and inst.weight_state("m2") == WeightState.HOST


def test_staging_never_evicts_the_active_models_kv():
    # m1 active (10 GB) with the idle KV of s1 (5 GB) and s2 (10 GB): staging m2 (10 GB) must free 5 GB.
    # Dropping s1's KV would cost a 0.5 s restore, within the 0.8 s staging saves, but s1 returns
    # within m1's slot, before m2 is needed: staging is refused and both prefixes stay
    inst = _inst(("m1", "m2"), staging=True)
    inst.switch_model("m1")
    t = _serve(inst, Call("s1", 0, "m1", 4900, 100, 0.0, 0.0), _run(inst))
    _serve(inst, Call("s2", 0, "m1", 9900, 100, 0.0, 0.0), t)
    assert not inst.stage_model("m2") and inst.weight_state("m2") == WeightState.HOST
    assert [inst.cached_prefix(s, "m1").device_tokens for s in ("s1", "s2")] == [5000, 10000]


@pytest.mark.parametrize("host_kv", [True, False])
def test_staging_evicts_only_what_costs_less_than_it_saves(host_kv):
    # u's 4.1 GB of m3 KV idle and m3 resident, m1 active: 24.1 of 30 GB. Staging m2 saves 1.0 - 0.2 s
    # (a PCIe load against a D2D copy) and must free 4.1 GB. With a host copy, u's KV comes back in
    # 0.41 s: it goes. Without one it costs a 8.2 s recompute, so the weights of m3 would go first,
    # a 1.0 s reload: more than staging saves, so staging is refused and nothing is evicted.
    inst = _inst(("m1", "m2", "m3"), staging=True, host_kv=host_kv)
    inst.switch_model("m3")
    t = _serve(inst, Call("u", 0, "m3", 4000, 100, 0.0, 0.0), _run(inst))
    inst.switch_model("m1")
    _run(inst, t)
    assert inst.stage_model("m2") == host_kv
    assert inst.weight_state("m3") == WeightState.RESIDENT
    assert inst.cached_prefix("u", "m3").device_tokens == (0 if host_kv else 4100)
