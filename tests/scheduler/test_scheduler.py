"""Scheduler mechanisms on hand-computable SimInstance costs (talaria_jax.sim.toys: 1 GPU, 10 GB
models that load in 1.0 s, stage-to-slot in 0.2 s, prefill 1000 tokens in 2.002 s)."""
import dataclasses
import math
import pathlib
import re

import pytest

from talaria_jax.scheduler import (AdmissionBudget, Call, Hints, RoundMultiplexer, Scheduler, SessionTable, WeightState,
                                   get_policy, rank, talaria_score)
from talaria_jax.sim.cluster import replay
from talaria_jax.sim.instance import SimInstance
from talaria_jax.scheduler.estimates import CallTimes, SessionLengths, ToolGaps
from talaria_jax.sim.toys import TOY_HW, TOY_SHAPES, toy_model


def _inst(name, **kw):
    kw = {"host_kv": True, "staging": True, "drop_kv_on_switch": False, **kw}
    return SimInstance(name, TOY_HW, TOY_SHAPES, ("m1", "m2"), **kw)


def _run(inst, t=0.0):
    """Runs an instance's chunks until it is idle; returns the time."""
    end = inst.start_chunk(t)
    while end is not None:
        inst.finish_chunk(end)
        t = end
        end = inst.start_chunk(t)
    return t


def test_router_ranks_by_residency_locality_pressure():
    cold = _inst("cold")  # m1 only in host memory: a switch costs the 1.0 s load
    warm = _inst("warm")  # m1 active, nothing cached
    warm.switch_model("m1")
    _run(warm)
    local = _inst("local")  # m1 active and session s's 1100-token prefix on device
    local.switch_model("m1")
    t = _run(local)
    local.admit(Call("s", 0, "m1", 1000, 100, 0.0, 0.0))
    _run(local, t)
    assert local.cached_prefix("s", "m1").device_tokens == 1100
    call = Call("s", 1, "m1", 2000, 10, 0.0)
    pol = get_policy("talaria")
    # 2 exp(-switch/2) + 1 x locality - 1 x (queue/16 + kv_util)
    assert talaria_score(pol, call, cold, 0) == pytest.approx(2 * math.exp(-0.5))
    assert talaria_score(pol, call, warm, 0) == pytest.approx(2.0)
    assert talaria_score(pol, call, local, 0) == pytest.approx(2.0 + 1100 / 2000)
    assert talaria_score(pol, call, warm, 8) == pytest.approx(2.0 - 0.5)  # 8 routed calls = half a queue_ref
    sessions = SessionTable([Call("s", 0, "m1", 1000, 100, 0.0, 0.0), call])
    order = [i.name for i in rank(pol, call, sessions["s"], [cold, warm, local], {})]
    assert order == ["local", "warm", "cold"]
    # least-loaded ignores residency and locality; sticky puts the last instance first
    assert [i.name for i in rank(get_policy("load"), call, sessions["s"], [cold, warm, local], {"cold": 1})] == \
        ["warm", "local", "cold"]
    sessions["s"].last_instance = "cold"
    assert rank(get_policy("sticky"), call, sessions["s"], [cold, warm, local], {})[0].name == "cold"


def test_returning_session_not_charged_for_its_own_reserved_kv():
    # the session's 1100-token prefix is protected on `local` (reserved for its return): for its own
    # next call that is locality, not pressure; for another session it is pressure (1100 of 20000 pages)
    local = _inst("local")
    local.switch_model("m1")
    t = _run(local)
    local.admit(Call("s", 0, "m1", 1000, 100, 0.0, 0.0))
    t = _run(local, t)
    local.protect_kv("s", t + 10.0)
    pol = get_policy("talaria")
    pages = local.kv_pages_total()
    assert local.kv_pages_reserved() == local.pages_for("m1", 1100) and local.kv_pages_reserved("s") == 0
    assert talaria_score(pol, Call("s", 1, "m1", 2000, 10, 0.0), local, 0) == pytest.approx(2.0 + 1100 / 2000)
    other = talaria_score(pol, Call("x", 0, "m1", 2000, 10, 0.0, 0.0), local, 0)
    assert other == pytest.approx(2.0 - local.pages_for("m1", 1100) / pages)


class _Stub:
    """Just enough of InstanceAPI for the budget: 1000 pages, some used, some running."""

    def __init__(self, used, running):
        self.used, self.running = used, running

    def kv_pages_total(self):
        return 1000

    def kv_pages_used(self):
        return self.used

    def num_running(self):
        return self.running

    def num_waiting(self):
        return 0


def test_reservation_charge_decays_and_lapses():
    b = AdmissionBudget(horizon_s=10.0)
    r = b.reserve("a", "m1", 400, now=0.0)
    assert [r.charge(t) for t in (0.0, 5.0, 10.0)] == [400, 200, 0]
    busy = _Stub(used=500, running=1)
    assert not b.fits(busy, "x", 200, now=0.0)  # 1000 - 500 - 400 = 100 < 200
    assert b.fits(busy, "a", 200, now=0.0)  # a session is not charged for its own reservation
    assert b.fits(busy, "x", 200, now=7.5)  # charge has decayed to 100: room 400
    assert b.fits(_Stub(used=0, running=0), "x", 900, now=0.0)  # never idles an instance
    assert b.expire(9.99) == [] and b.expire(10.0) == ["a"]
    assert b.charged_pages(10.0) == 0


def test_finished_call_reserves_on_the_instance_that_served_it():
    insts = [_inst("i0"), _inst("i1")]
    calls = [Call("a", 0, "m1", 1000, 10, 1.0, 0.0), Call("a", 1, "m1", 1500, 10, 0.0)]
    sessions = SessionTable(calls)
    sched = Scheduler(get_policy("talaria"), insts, sessions)
    sessions.complete(calls[0], "i1", 3.0)
    sched.on_finish(calls[0], insts[1], 3.0)
    res = sched.state["i1"].budget.reservations["a"]
    assert res.pages == insts[1].pages_for("m1", 1010 + 1000)  # context after the call + expected growth
    assert "a" not in sched.state["i0"].budget.reservations
    sched.plan(insts[1], 3.0 + get_policy("talaria").reserve_horizon_s)
    assert "a" not in sched.state["i1"].budget.reservations  # lapsed
    sched.on_finish(calls[0], insts[1], 20.0)
    sched.on_arrival(calls[1], 20.5)
    assert "a" not in sched.state["i1"].budget.reservations  # released by the return


_SP_TRACE = [Call("a", 0, "m1", 1000, 10, 0.1, 0.0), Call("a", 1, "m1", 1100, 10, 0.0),
             Call("b", 0, "m2", 1000, 10, 0.0, 0.1)]


def _order(res):
    return [(r.session, r.turn) for r in sorted(res.records, key=lambda r: r.done_s)]


def test_session_prefill_admits_continuation_before_slot_closes():
    # a0 finishes at ~4.10 s; its continuation arrives 0.1 s later while m1's slot is open
    res = replay(_SP_TRACE, get_policy("talaria"), TOY_HW, TOY_SHAPES, seed=0, jitter_sigma=0, gap_jitter_sigma=0)
    assert _order(res) == [("a", 0), ("a", 1), ("b", 0)]
    log = res.instances[0].stats.switch_log
    assert [m for _, m, _ in log] == ["m1", "m2"]
    assert log[0][2] == pytest.approx(1.0)  # cold load of m1
    assert log[1][2] == pytest.approx(0.2)  # m2 was staged during m1's slot: D2D only
    a0, a1 = sorted((r for r in res.records if r.session == "a"), key=lambda r: r.turn)
    # by hand: 1.0 load + 2.002 prefill + 10 decode steps of ~0.1101 s = 4.1025 s, then the 0.1 s gap
    assert a0.done_s == pytest.approx(4.1025, abs=1e-3) and a1.issued_s == pytest.approx(a0.done_s + 0.1)
    assert a1.done_s <= log[1][0]  # served inside m1's slot, before the switch to m2


def test_without_sp_the_continuation_waits_a_round():
    for name in ("talaria-no-sp", "round"):
        res = replay(_SP_TRACE, get_policy(name), TOY_HW, TOY_SHAPES, seed=0, jitter_sigma=0, gap_jitter_sigma=0)
        assert _order(res) == [("a", 0), ("b", 0), ("a", 1)], name
        assert [m for _, m, _ in res.instances[0].stats.switch_log] == ["m1", "m2", "m1"], name


def test_session_prefill_admits_a_new_sessions_first_call_of_the_active_model():
    # as above, but the call that comes 0.1 s after a0 ends is the first call of a new m1 session c:
    # talaria's SP admits it in m1's open slot; the paper's SP (continuations only) leaves it for
    # m1's next slot, after m2's. m2 must be next once m1's slot ends: under the chain order it is;
    # under the default order m1's two sessions outrank m2's one unless b asks for a higher priority
    trace = _SP_TRACE[:1] + [Call("c", 0, "m1", 1100, 10, 0.0, 4.2025)] + _SP_TRACE[2:]
    urgent = trace[:2] + [dataclasses.replace(trace[2], hints=Hints(priority=3))]
    chain = get_policy("talaria-chain")
    for calls, pol, order in ((trace, chain, [("a", 0), ("c", 0), ("b", 0)]),
                              (trace, dataclasses.replace(chain, sp_first_calls=False), [("a", 0), ("b", 0), ("c", 0)]),
                              (urgent, get_policy("talaria"), [("a", 0), ("c", 0), ("b", 0)]),
                              (urgent, get_policy("talaria-sp-continuations"), [("a", 0), ("b", 0), ("c", 0)])):
        res = replay(calls, pol, TOY_HW, TOY_SHAPES, seed=0, jitter_sigma=0, gap_jitter_sigma=0)
        assert _order(res) == order, pol.name


def test_round_multiplexer_order():
    mux = RoundMultiplexer(("m1", "m2", "m3"), slot_s=5.0)
    assert mux.next_model(set()) is None
    assert mux.next_model({"m2", "m3"}) == "m2"
    mux.open("m2", 0.0)
    assert mux.is_open(4.9) and not mux.is_open(5.0)
    assert mux.next_model({"m1", "m2", "m3"}) == "m3"
    assert mux.next_model({"m1", "m2"}) == "m1"  # wraps around
    assert mux.next_model({"m2"}) == "m2"  # its own model again only when nobody else waits
    assert mux.after("m3", {"m1", "m2", "m3"}) == "m1" and mux.last_model == "m2"


def test_round_multiplexer_priority_order():
    mux = RoundMultiplexer(("m1", "m2", "m3"), slot_s=5.0)
    mux.open("m2", 0.0)
    # ring after m2 is m3, m1, m2: the highest weight wins, equals in ring order
    assert mux.next_model({"m1", "m2", "m3"}, {"m1": 1, "m2": 3, "m3": 3}) == "m3"
    assert mux.next_model({"m1", "m2"}, {"m1": 1, "m2": 5}) == "m2"  # a busier model keeps the next slot
    assert mux.next_model({"m1", "m3"}, {}) == "m3"  # no weights: round order
    assert mux.after("m3", {"m1", "m2", "m3"}, {"m2": 2}) == "m2"


def _switch_order(calls, policy, shapes=TOY_SHAPES):
    """The models a one-instance replay without jitter switches to, in order."""
    res = replay(calls, get_policy(policy), TOY_HW, shapes, seed=0, jitter_sigma=0, gap_jitter_sigma=0)
    return [m for _, m, _ in res.instances[0].stats.switch_log]


def test_popular_first_serves_the_model_with_most_sessions_first():
    # one session of m1 starts first; then one of m2; then two of m3
    calls = [Call("x", 0, "m1", 1000, 10, 0.0, 0.0), Call("x", 1, "m1", 1100, 10, 0.0),
             Call("y", 0, "m2", 1000, 10, 0.0, 0.01), Call("z1", 0, "m3", 1000, 10, 0.0, 0.02),
             Call("z2", 0, "m3", 1000, 10, 0.0, 0.03)]
    assert _switch_order(calls, "talaria-round-robin") == ["m1", "m2", "m3"]
    assert _switch_order(calls, "talaria-popular-first") == ["m1", "m3", "m2"]


def test_round_replay_visits_models_in_order():
    calls = [Call("a", 0, "m1", 1000, 10, 0.0, 0.02), Call("b", 0, "m2", 1000, 10, 0.0, 0.03),
             Call("c", 0, "m3", 1000, 10, 0.0, 0.0), Call("c", 1, "m3", 1100, 10, 0.0)]
    shapes = TOY_SHAPES
    res = replay(calls, get_policy("round"), TOY_HW, shapes, seed=0, jitter_sigma=0, gap_jitter_sigma=0)
    assert [m for _, m, _ in res.instances[0].stats.switch_log] == ["m3", "m1", "m2", "m3"]
    assert _order(res) == [("c", 0), ("a", 0), ("b", 0), ("c", 1)]


def test_switch_costs_follow_weight_state():
    inst = _inst("i")
    assert inst.estimate_switch_s("m1") == pytest.approx(1.0)
    inst.switch_model("m1")
    t = _run(inst)
    assert inst.stage_model("m2") and inst.weight_state("m2") == WeightState.STAGING
    inst.now = t + 0.5
    assert inst.estimate_switch_s("m2") == pytest.approx(0.5 + 0.2)
    inst.now = t + 1.0
    assert inst.weight_state("m2") == WeightState.STAGED and inst.estimate_switch_s("m2") == pytest.approx(0.2)


def test_scheduler_imports_neither_engine_nor_sim_nor_jax():
    root = pathlib.Path(__file__).resolve().parents[2]
    bad = re.compile(r"^\s*(import|from)\s+(jax|flax|talaria_jax\.(engine|sim|instance|models))\b", re.M)
    for p in list((root / "scheduler").glob("*.py")) + list((root / "talaria_jax" / "sim").glob("*.py")) + \
            [root / "talaria_jax" / "launch" / "replay.py"]:
        text = p.read_text()
        if p.parent.name == "sim" or p.name == "replay.py":
            assert not re.search(r"^\s*(import|from)\s+(jax|flax)\b", text, re.M), p
        else:
            assert not bad.search(text), p


def test_slot_length_follows_the_switch_it_amortises():
    mux = RoundMultiplexer(("m1", "m2"), slot_s=20.0, switches_per_slot=10.0, min_slot_s=2.2)
    assert [mux.slot_length(s) for s in (0.0, 0.1, 1.0, 2.73)] == pytest.approx([2.2, 2.2, 10.0, 20.0])
    mux.open("m1", 5.0)
    assert mux.is_open(7.1) and mux.slot.deadline_s == 25.0  # nobody else waits yet: slot_s
    mux.bound(0.0)  # another model waits and is resident: its activation is free
    assert mux.is_open(7.1) and not mux.is_open(7.2)
    mux.bound(5.0)  # bounded once, by the estimate taken before staging
    assert mux.slot.deadline_s == pytest.approx(7.2)
    fixed = RoundMultiplexer(("m1", "m2"), slot_s=20.0)
    fixed.open("m1", 5.0)
    fixed.bound(0.0)
    assert fixed.slot.deadline_s == 25.0


def test_scheduler_bounds_slot_by_the_round_switch_cost():
    # toy: m2 in host memory costs a 1.0 s load, so m1's slot is 10 x 1.0 s; resident m2 is free: 2.2 s
    for resident, length in ((False, 10.0), (True, 2.2)):
        inst = _inst("i")
        if resident:  # load m2, then m1: m2 stays resident (20 GB of weights in 30 GB)
            for m in ("m2", "m1"):
                inst.switch_model(m)
                _run(inst)
        calls = [Call("a", 0, "m1", 1000, 10, 0.0, 0.0), Call("b", 0, "m2", 1000, 10, 0.0, 0.0)]
        sched = Scheduler(get_policy("talaria"), [inst], SessionTable(calls))
        sched.on_arrival(calls[0], 0.0)
        sched.plan(inst, 0.0)
        if not resident:  # m1 was loaded by the switch issued above
            _run(inst)
            sched.plan(inst, 1.0)
        slot = sched.state["i"].mux.slot
        assert slot.model == "m1" and slot.deadline_s == slot.opened_s + 20.0
        sched.on_arrival(calls[1], slot.opened_s + 0.5)
        sched.plan(inst, slot.opened_s + 0.5)
        assert slot.deadline_s == pytest.approx(slot.opened_s + length), resident


# m2 warms up (w0) so that it stays resident next to m1; a and c run on m1; b (m2) arrives while m1's
# slot is open and m2 is resident, so that slot is bounded to 2.2 s; a1 returns at ~8.5 s while c's long
# decode keeps the slot busy: after the bound SP no longer admits it and b goes first.
_CORES_TRACE = [Call("w", 0, "m2", 1000, 1, 0.0, 0.0),
                Call("a", 0, "m1", 1000, 10, 0.1, 0.5), Call("a", 1, "m1", 1100, 10, 0.0),
                Call("c", 0, "m1", 1000, 100, 0.0, 0.5),
                Call("b", 0, "m2", 1000, 10, 0.0, 4.0)]


def test_free_switch_shortens_the_slot_so_a_waiting_model_goes_first():
    # round-robin slots: under a priority order m1 keeps its slot while it ranks first (a's session is
    # expected to end sooner than b's), whatever the slot's bound
    import dataclasses
    res = replay(_CORES_TRACE, get_policy("talaria-round-robin"), TOY_HW, TOY_SHAPES, seed=0, jitter_sigma=0, gap_jitter_sigma=0)
    done = {(r.session, r.turn): r.done_s for r in res.records}
    assert done[("b", 0)] < done[("a", 1)]
    assert [m for _, m, _ in res.instances[0].stats.switch_log] == ["m2", "m1", "m2", "m1"]
    assert [d for _, _, d in res.instances[0].stats.switch_log][2:] == [0.0, 0.0]  # resident: free activations
    # the fixed 20 s slot (the mechanism off) keeps admitting a's return by SP, and b waits for it
    fixed = dataclasses.replace(get_policy("talaria-round-robin"), switches_per_slot=None)
    res = replay(_CORES_TRACE, fixed, TOY_HW, TOY_SHAPES, seed=0, jitter_sigma=0, gap_jitter_sigma=0)
    done = {(r.session, r.turn): r.done_s for r in res.records}
    assert done[("a", 1)] < done[("b", 0)]
    assert [m for _, m, _ in res.instances[0].stats.switch_log] == ["m2", "m1", "m2"]


def test_on_demand_quantum_follows_the_switch_it_amortises():
    # m2 stays resident after serving w, so switching back to it is free: composite's quantum for m1
    # shrinks to min_slot_s once b waits, instead of m1 keeping the GPU for the fixed 20 s.
    import dataclasses
    sess = "acdefghi"
    trace = [Call("w", 0, "m2", 100, 1, 0.0, 0.0)]
    for k, s in enumerate(sess):
        trace += [Call(s, i, "m1", 100 + 40 * i, 10 + 3 * k, 0.0, 0.2 + 0.05 * k if i == 0 else None)
                  for i in range(30)]
    trace += [Call("b", 0, "m2", 100, 10, 0.0, 3.0)]
    bounded = replay(trace, get_policy("composite"), TOY_HW, TOY_SHAPES, seed=0, jitter_sigma=0, gap_jitter_sigma=0)
    fixed = replay(trace, dataclasses.replace(get_policy("composite"), switches_per_slot=None), TOY_HW, TOY_SHAPES,
                   seed=0, jitter_sigma=0, gap_jitter_sigma=0)
    b_done = [{(r.session, r.turn): r.done_s for r in res.records}[("b", 0)] for res in (bounded, fixed)]
    assert b_done[0] < 10.0 < 20.0 < b_done[1]


def test_smith_order_serves_the_most_sessions_per_second_first():
    # x (m1) starts first; then y of m2, whose weights are 1.5x as large (its decode steps take
    # 1.5x as long), then z of m3: round robin serves m2 before m3, Smith's rule the faster m3 first
    shapes = {**TOY_SHAPES, "m2": toy_model("m2", weights_gb=15.0)}
    calls = [Call("x", 0, "m1", 1000, 10, 0.0, 0.0), Call("x", 1, "m1", 1100, 10, 0.0),
             Call("y", 0, "m2", 1000, 50, 0.0, 0.01), Call("z", 0, "m3", 1000, 50, 0.0, 0.02)]
    assert _switch_order(calls, "talaria-round-robin", shapes) == ["m1", "m2", "m3"]
    assert _switch_order(calls, "talaria-smith", shapes) == ["m1", "m3", "m2"]


def test_smith_order_keeps_the_slot_and_bounds_the_wait():
    # three m1 sessions return at once (no tool time) while one m2 call waits: without a bound on the
    # wait m1 keeps its slot past every deadline (no drain) until its sessions end; with max_wait_s=3
    # the m2 call is served as soon as the m1 slot's deadline passes after 3 s of waiting
    calls = [Call(s, k, "m1", 1000 + 100 * k, 10, 0.0, 0.0 if k == 0 else None) for s in "abc" for k in range(6)]
    calls.append(Call("d", 0, "m2", 1000, 10, 0.0, 0.01))
    done = {}
    for wait in (1e9, 3.0):
        pol = dataclasses.replace(get_policy("talaria-smith"), max_wait_s=wait)
        res = replay(calls, pol, TOY_HW, TOY_SHAPES, seed=0, jitter_sigma=0, gap_jitter_sigma=0)
        done[wait] = {r.session: r.done_s for r in res.records}
        m1_end = max(done[wait][s] for s in "abc")
        assert (done[wait]["d"] > m1_end) == (wait == 1e9), (wait, done[wait])
    assert [m for _, m, _ in res.instances[0].stats.switch_log][:3] == ["m1", "m2", "m1"]


def test_tool_gaps_use_the_prior_until_enough_are_seen():
    gaps = ToolGaps(13.6, 18.4, 216.0, window=100, min_seen=16)  # docs/references.md's p90, mean and p99
    assert gaps.p90() == 13.6

    def gap(g: float) -> None:
        gaps.begin("s", 0.0)
        assert gaps.end("s", g)

    for g in range(15):
        gap(float(g))
    assert gaps.p90() == 13.6
    for g in range(15, 200):  # the window keeps the last 100: 100..199
        gap(float(g))
    assert gaps.p90() == pytest.approx(189.1)


def test_tool_gap_mean_counts_the_gaps_still_open():
    gaps = ToolGaps(13.6, 18.4, 216.0)
    assert gaps.mean(0.0) == 18.4  # the prior alone
    for sid, (t0, t1) in {"a": (0.0, 1.0), "b": (0.0, 3.0)}.items():
        gaps.begin(sid, t0)
        gaps.end(sid, t1)
    assert gaps.mean(3.0) == pytest.approx((18.4 + 1 + 3) / 3)
    gaps.begin("c", 10.0)  # a long gap still running at 50 s: 40 s of gap time, no gap closed yet
    assert gaps.mean(50.0) == pytest.approx((18.4 + 1 + 3 + 40) / 3)
    gaps.end("c", 0.0, observe=False)  # the session went away: its gap is dropped, not counted
    assert gaps.mean(50.0) == pytest.approx((18.4 + 1 + 3) / 3)
    assert not gaps.end("c", 60.0)
    gaps.begin("d", 100.0)  # open past the p99 (216 s): closed at 216 s, its session most likely gone
    assert gaps.mean(400.0) == pytest.approx((18.4 + 1 + 3 + 216) / 4)
    assert not gaps.end("d", 500.0)


def test_session_lengths_count_the_long_sessions_still_running():
    lengths = SessionLengths()
    assert lengths.left(0) == 1  # nothing seen
    for k in range(3):  # running sessions, no end seen: the longest has issued 3 calls, so 3 more
        lengths.issued(f"r{k}", k + 1)
    assert [lengths.left(k) for k in range(4)] == [6, 5, 4, 3]
    lengths = SessionLengths()
    for sid, n in (("a", 2), ("b", 10)):  # ended sessions alone: the conditional mean
        lengths.issued(sid, n)
        lengths.end(sid)
    assert [lengths.left(0), lengths.left(2)] == pytest.approx([6, 8])
    # four ended after 2 calls while four have issued 20 and go on: the mean of the ended (2) would
    # miss them; Kaplan-Meier halves P(N > 2) and keeps the rest past 20, about 20 calls more
    lengths = SessionLengths()
    for k in range(4):
        lengths.issued(f"short{k}", 2)
        lengths.end(f"short{k}")
        lengths.issued(f"long{k}", 20)
    assert lengths.left(0) == pytest.approx(2 + 0.5 * 18 + 0.5 * 20)
    assert lengths.left(5) == pytest.approx(15 + 20)
    assert lengths.left(40) == 40  # past everything seen: as many more
    # a session taken as ended after a gap past the p99 that comes back is running again
    lengths.end("long0", reopen=True)
    assert lengths.left(0) < 2 + 0.5 * 18 + 0.5 * 20
    lengths.issued("long0", 21)
    assert lengths.ended[20] == 0 and lengths.running["long0"] == 21


def test_call_times_are_not_moved_by_a_compilation():
    times = CallTimes()
    assert times.get("m") is None
    for s in (30.0, 1.0, 1.2, 0.8):  # the first call compiled
        times.add("m", s)
    assert times.get("m") == pytest.approx(1.1)  # the median of the first four
    times.add("m", 60.0)  # a switch or another compilation: clipped at 4x
    assert times.get("m") == pytest.approx(1.1 + 0.1 * (4.4 - 1.1))


@pytest.mark.parametrize("policy", ["talaria", "talaria-chain"])
def test_the_slot_order_ages_a_call_whose_model_is_not_its_sessions_first(policy):
    # a live session may call another model later (the serving path allows it): its pending m2 call
    # gets a weight of its own and ages, rather than waiting behind m1 for good
    calls = [Call("x", 0, "m1", 1000, 10, 0.0, 0.0), Call("x", 1, "m2", 1100, 10, 0.0), Call("y", 0, "m1", 1000, 10, 0.0, 0.0)]
    inst = _inst("i")
    sched = Scheduler(get_policy(policy), [inst], SessionTable(calls))
    sched.on_arrival(calls[2], 0.5)
    sched.sessions.complete(calls[0], "i", 0.0)
    sched.on_arrival(calls[1], 0.0)
    assert set(sched.slot_priority(inst, 1.0)) == {"m1", "m2"} and max(sched.slot_priority(inst, 1.0).values()) < 1e12
    prio = sched.slot_priority(inst, 1e5)
    assert prio["m2"] > 1e12 and max(prio, key=prio.get) == "m2"  # aged, and waited longest


def test_a_session_in_its_tool_gap_counts_for_the_model_it_used_last():
    # x calls m1 then m2 and is in its tool gap: the slot order and the reservation expect it back on
    # m2 (its last call's model), not on its first call's, and never read its next call from the trace
    calls = [Call("x", 0, "m1", 1000, 10, 0.0, 0.0), Call("x", 1, "m2", 1100, 10, 0.0), Call("x", 2, "m1", 1200, 10, 0.0)]
    inst = _inst("i")
    sched = Scheduler(get_policy("talaria-smith"), [inst], SessionTable(calls))
    for k, t in ((0, 0.0), (1, 1.0)):
        sched.on_arrival(calls[k], t)
        sched.sessions.complete(calls[k], "i", t + 0.5)
        sched.on_finish(calls[k], inst, t + 0.5)
        assert sched.sessions["x"].model == calls[k].model
        assert set(sched.slot_priority(inst, t + 0.6)) == {calls[k].model}
        assert sched.state["i"].budget.reservations["x"].model == calls[k].model
    sched.on_arrival(calls[2], 2.0)  # back on m1: its pending call counts for m1, not for the model it used last
    assert set(sched.slot_priority(inst, 2.1)) == {"m1"}


def test_router_credits_a_compacted_call_only_its_stated_prefix():
    local = _inst("local")  # session s's 1100-token prefix on device
    local.switch_model("m1")
    t = _run(local)
    local.admit(Call("s", 0, "m1", 1000, 100, 0.0, 0.0))
    _run(local, t)
    pol = get_policy("talaria")
    full = Call("s", 1, "m1", 2000, 10, 0.0)
    compacted = Call("s", 1, "m1", 2000, 10, 0.0, prefix_tokens=500)  # the agent kept 500 tokens of it
    assert talaria_score(pol, full, local, 0) == pytest.approx(2.0 + 1100 / 2000)
    assert talaria_score(pol, compacted, local, 0) == pytest.approx(2.0 + 500 / 2000)


def test_a_priority_order_keeps_the_slot_while_its_sessions_end_soonest():
    # three m1 sessions return at once (no tool time) while one m2 call waits: round-robin slots
    # (10 s here: 10 x the 1.0 s load) serve m2 before m1's sessions end; the default order and the
    # chain order keep the slot with m1, whose three sessions end sooner per second of slot, and
    # serve m2 after them
    calls = [Call(s, k, "m1", 1000 + 100 * k, 10, 0.0, 0.0 if k == 0 else None) for s in "abc" for k in range(6)]
    calls.append(Call("d", 0, "m2", 1000, 10, 0.0, 0.01))
    for policy, d_last in (("talaria-round-robin", False), ("talaria", True), ("talaria-chain", True)):
        res = replay(calls, get_policy(policy), TOY_HW, TOY_SHAPES, seed=0, jitter_sigma=0, gap_jitter_sigma=0)
        done = {r.session: r.done_s for r in res.records}
        assert (done["d"] > max(done[s] for s in "abc")) == d_last, (policy, done)


def _sessions_ended_after(sched: Scheduler, calls: int, n: int = 1000) -> None:
    """What `sched` has seen before: `n` sessions that ended after `calls` calls each."""
    for k in range(n):
        sched.lengths.issued(f"past{k}", calls)
        sched.lengths.end(f"past{k}")


def test_chain_order_ages_a_call_by_the_critical_chain():
    # m1 has three sessions, pending since 0.5 s, and m2 one, since 0: Smith's rule ranks m1 first.
    # m2's call ages after all the work left here when its model's tool gaps are short (postponing it
    # costs its session nothing past the end of that work), but after one slot of m1 when they are
    # long (its session's chain of calls and gaps is then longer than all the work left)
    calls = [Call(s, 0, "m1", 1000, 10, 0.0, 0.0) for s in "abc"] + [Call("d", 0, "m2", 1000, 10, 0.0, 0.0)]
    aged_at = {}
    for gap in (0.0, 60.0):
        inst = _inst("i")
        sched = Scheduler(get_policy("talaria-chain"), [inst], SessionTable(calls))
        _sessions_ended_after(sched, 32)
        for c in calls:
            sched.on_arrival(c, 0.0 if c.model == "m2" else 0.5)
        for k in range(100):  # other sessions' closed tool gaps set the observed mean
            sched.gaps.begin(f"other{k}", 0.0)
            sched.gaps.end(f"other{k}", gap)
        slot = sched.state["i"].mux.slot_length(inst.estimate_switch_s("m1"))
        assert sched.lengths.left(0) == 32
        work = 32 * (inst.estimate_service_s(calls[0]) + inst.estimate_service_s(calls[-1]))
        aged_at[gap] = next(t for t in range(0, 2000) if max(sched.slot_priority(inst, float(t)).items(),
                                                            key=lambda kv: kv[1])[0] == "m2")
        assert aged_at[gap] == math.ceil(slot if gap else work), (gap, aged_at[gap], slot, work)
    assert aged_at[60.0] < aged_at[0.0]


@pytest.mark.parametrize("patience", [0.0, 0.5, 2.0, math.inf])
def test_patience_scales_the_wait_before_a_call_ages(patience):
    # as above with short tool gaps: m2's call ages after patience x all the work left here; at 0 it
    # goes first at once (oldest call first, the p95 end), at inf never (Smith's rule alone, the p50 end)
    calls = [Call(s, 0, "m1", 1000, 10, 0.0, 0.0) for s in "abc"] + [Call("d", 0, "m2", 1000, 10, 0.0, 0.0)]
    inst = _inst("i")
    sched = Scheduler(get_policy(f"talaria[patience={patience}]"), [inst], SessionTable(calls))
    _sessions_ended_after(sched, 32)
    for c in calls:
        sched.on_arrival(c, 0.0 if c.model == "m2" else 0.5)
    for k in range(100):
        sched.gaps.begin(f"other{k}", 0.0)
        sched.gaps.end(f"other{k}", 0.0)
    work = 32 * (inst.estimate_service_s(calls[0]) + inst.estimate_service_s(calls[-1]))
    first = lambda t: max(sched.slot_priority(inst, float(t)).items(), key=lambda kv: kv[1])[0]
    aged_at = next((t for t in range(0, 4000) if first(t) == "m2"), None)
    assert aged_at == (None if patience == math.inf else math.ceil(patience * work)), (aged_at, work)


def test_a_policy_name_changes_numeric_fields():
    p = get_policy("talaria[patience=0.5;reserve_growth_tokens=500]")
    assert (p.patience, p.reserve_growth_tokens, p.slot_order) == (0.5, 500, "srpt")
    for bad, msg in (("talaria[patience=soon]", "patience='soon' is not a number"),
                     ("talaria[router=1]", "'router' is not a numeric field of PolicyConfig"),
                     ("talaria[patience=-1]", "patience=-1.0 must be >= 0"),
                     ("talaria[reserve_growth_tokens=1.5]", "must be an integer"),
                     ("fastest[patience=1]", "unknown policy 'fastest'")):
        with pytest.raises(ValueError, match=re.escape(msg)):
            get_policy(bad)


def test_chain_order_does_not_keep_short_calls_behind_a_younger_aged_call():
    # m1's calls take 20 s, m2's 0.1 s (a 135M model next to a tiny one on a CPU): m1's chain is
    # critical, so its call pending since 0.5 s ages after one round of slots; m2's call has waited
    # since 0 and its work fits in one slot, so it ages with it and, older, goes first, instead of
    # waiting for all of m1's work
    calls = [Call(s, k, "m1", 1000, 10, 0.0) for s in "abc" for k in range(3)] + \
        [Call("d", k, "m2", 1000, 10, 0.0) for k in range(2)]
    inst = _inst("i")
    sched = Scheduler(get_policy("talaria-chain"), [inst], SessionTable(calls))
    for model, seconds in (("m1", 20.0), ("m2", 0.1)):
        for _ in range(4):
            sched.call_s.add(model, seconds)
    for k in range(100):  # tool gaps of 0.3 s
        sched.gaps.begin(f"other{k}", 0.0)
        sched.gaps.end(f"other{k}", 0.3)
    for sid in "abc":
        sched.sessions[sid].next_turn = 2
    sched.sessions["d"].next_turn = 1
    sched.on_arrival(calls[-1], 0.0)
    sched.on_arrival(calls[2], 0.5)
    round_s = sched.state["i"].mux.slot_length(inst.estimate_switch_s("m2"))
    prio = sched.slot_priority(inst, 0.5 + round_s + 0.1)
    assert prio["m1"] > 1e12 and max(prio, key=prio.get) == "m2", prio


def test_srpt_order_serves_the_sessions_nearest_their_end_first_and_ages_after_all_work_left():
    # m1: one session at its last call (of the 32 every session so far has made) and one with 31 calls left;
    # m2: one session with 14 left. The chain order weighs each model by its furthest-behind
    # session (m1 2 / 31 calls < m2 1 / 14); shortest remaining first sums over the sessions
    # (m1 1 + 1/31 > m2 1/14), so the session one call from its end is served first
    calls = [Call("a", 31, "m1", 1000, 10, 0.0), Call("b", 1, "m1", 1000, 10, 0.0), Call("c", 18, "m2", 1000, 10, 0.0)]
    first = {}
    for policy in ("talaria-chain", "talaria"):
        inst = _inst("i")
        sched = Scheduler(get_policy(policy), [inst], SessionTable(calls))
        _sessions_ended_after(sched, 32)
        for c in calls:
            sched.sessions[c.session].next_turn = c.turn
            sched.on_arrival(c, 0.0 if c.model == "m2" else 0.5)
        prio = sched.slot_priority(inst, 1.0)
        first[policy] = max(prio, key=prio.get)
    assert first == {"talaria-chain": "m2", "talaria": "m1"}
    # m2's call, pending since 0, ages once it has waited as long as all the work left here: 31 calls
    # of m1 and 14 of m2 at the instance's estimate of one call each
    assert [sched.lengths.left(k) for k in (31, 1, 18)] == pytest.approx([1, 31, 14], abs=0.05)
    work = sched.lengths.left(1) * inst.estimate_service_s(calls[0]) + \
        sched.lengths.left(18) * inst.estimate_service_s(calls[2])
    aged = next(t for t in range(2000) if max((p := sched.slot_priority(inst, float(t))), key=p.get) == "m2")
    assert aged == math.ceil(work)


# ---- agent hints ----------------------------------------------------------------------------------

def test_hints_name_the_bad_field_and_its_limit():
    for kw, pattern in (({"calls_left": -1}, r"calls_left must be an integer >= 0"),
                        ({"tool_s": float("nan")}, r"tool_s must be a finite number"),
                        ({"priority": 9}, r"priority must be an integer in \[-8, 8\]")):
        with pytest.raises(ValueError, match=pattern):
            Hints(**kw)
    assert not Hints() and Hints(priority=1) and Hints(calls_left=0).as_dict() == {"calls_left": 0}


def _finished(hints: Hints, turns: int = 2, policy: str = "talaria"):
    """A scheduler whose session "a" has finished its first call (with `hints`) on instance i0."""
    inst = _inst("i0")
    calls = [Call("a", k, "m1", 1000 + 20 * k, 10, 1.0, 0.0 if k == 0 else None) for k in range(turns)]
    calls[0] = dataclasses.replace(calls[0], hints=hints)
    sessions = SessionTable(calls)
    sched = Scheduler(get_policy(policy), [inst], sessions)
    sched.hints.min_checked = 0  # as if earlier sessions had borne their hints out
    sched.on_arrival(calls[0], 0.0)
    sessions.complete(calls[0], "i0", 3.0)
    sched.on_finish(calls[0], inst, 3.0)
    return sched, inst, calls


def test_a_call_hinted_last_reserves_nothing_and_ends_its_session():
    # without a hint the scheduler cannot know the session ended: it reserves for a return
    sched, _, _ = _finished(Hints(), turns=1)
    assert "a" in sched.state["i0"].budget.reservations and "a" in sched.lengths.running
    sched, _, calls = _finished(Hints(calls_left=0), turns=1)
    assert sched.ends(calls[0]) and "a" not in sched.state["i0"].budget.reservations
    assert sched.lengths.ended[1] == 1 and "a" not in sched.state["i0"].finished


def test_hinted_tool_time_sets_the_reservation_and_the_slot_hold():
    from talaria_jax.scheduler.scheduler import hold_until

    sched, _, _ = _finished(Hints(tool_s=0.5))
    r = sched.state["i0"].budget.reservations["a"]
    assert (r.horizon_s, r.back_s) == (1.5 * 0.5 + 1.0, 3.5)
    assert hold_until(r, 2.2) == 3.0 + 1.75  # held until the hinted return, with its margin
    assert hold_until(dataclasses.replace(r, back_s=10.0), 2.2) == 3.0  # back after the hold: not held
    sched, _, _ = _finished(Hints(tool_s=100.0))  # far past the p90: no reservation, the KV may go to host
    assert "a" not in sched.state["i0"].budget.reservations


def _slot_terms(hints: Hints, later: Hints | None = None):
    """Session "a"'s weight (per second of its model's call) and calls left as the slot order sees
    them at 4.0 s, after `_finished(hints)` and, with `later`, its next call sent with those hints:
    "smith" weighs a model by its sessions' weights, "srpt" by their weights over their calls left,
    so smith / srpt is the calls "a" has left. Also the last scheduler."""
    prio = {}
    for order in ("smith", "srpt"):
        sched, inst, calls = _finished(hints, policy={"smith": "talaria-smith", "srpt": "talaria"}[order])
        assert sched.withdraw(calls[0])  # (never admitted: taken back, so that it does not age as pending)
        if later is not None:
            sched.on_arrival(dataclasses.replace(calls[1], hints=later), 4.0)
        prio[order] = sched.slot_priority(inst, 4.0)["m1"]
    return prio["smith"], prio["smith"] / prio["srpt"], sched


def test_calls_left_and_priority_hints_set_the_slot_order():
    one, left, sched = _slot_terms(Hints())  # no hint: weight 1, and the estimate of the calls left
    assert left == pytest.approx(sched.lengths.left(1))
    w, left, _ = _slot_terms(Hints(calls_left=7, priority=2))
    assert left == pytest.approx(7) and w == pytest.approx(4.0 * one)
    one, _, _ = _slot_terms(Hints(), later=Hints())
    w, left, sched = _slot_terms(Hints(calls_left=7, priority=2), later=Hints(priority=-1))  # later hints replace
    assert left == pytest.approx(sched.lengths.left(1)) and w == pytest.approx(0.5 * one)


def test_a_higher_priority_call_is_admitted_first():
    calls = [Call(s, 0, "m1", 4000, 10, 0.0, 0.0, hints=Hints(priority=p)) for s, p in (("low", 0), ("high", 3))]
    inst = _inst("i0")
    sched = Scheduler(get_policy("talaria"), [inst], SessionTable(calls))  # (priority needs no trust)
    for c in calls:
        sched.on_arrival(c, 0.0)
    assert [c.session for _, c in sorted(sched.state["i0"].pending, key=lambda tc: -tc[1].hints.priority)] == \
        ["high", "low"]
    assert sched.plan(inst, 0.0) is None and not sched.state["i0"].admitted  # a switch to m1 first
    sched.plan(inst, _run(inst))  # m1 is active: its slot opens and admits
    assert [c.session for c, _ in sched.state["i0"].admitted.values()] == ["high", "low"]


def test_hints_are_believed_once_borne_out_and_dropped_once_proved_wrong():
    from talaria_jax.scheduler.hints import HintBook

    book = HintBook(min_checked=3)
    ok = [Call(f"t{k}", 0, "m1", 100, 10, 0.0, hints=Hints(calls_left=3, tool_s=1.0)) for k in range(4)]
    book.arrived(ok[0], None, 0.0, 13.6)
    assert not book.believed("t0")  # nothing borne out yet
    for c in ok:  # four sessions bear their hints out (a next call, in time)
        book.arrived(c, None, 0.0, 13.6)
        book.arrived(dataclasses.replace(c, turn=1), 10.0, 11.0, 13.6)
    assert book.believed("t0") and book.sessions_checked == 4
    liar = Call("x", 0, "m1", 100, 10, 0.0, hints=Hints(calls_left=0))
    book.arrived(liar, None, 12.0, 13.6)
    book.finished(liar, 12.0)
    assert book.believed("x") and book.of(liar).calls_left == 0
    book.arrived(dataclasses.replace(liar, turn=1, hints=Hints(calls_left=5, priority=2)), 12.5, 13.0, 13.6)  # back
    assert not book.believed("x") and book.of(book.latest["x"]) == Hints(priority=2)  # priority is still taken
    assert book.believed("t0")  # one wrong session in five: the others are still believed
    late = Call("y", 0, "m1", 100, 10, 0.0, hints=Hints(tool_s=1.0))
    book.arrived(late, None, 14.0, 13.6)
    book.arrived(dataclasses.replace(late, turn=1), 14.0, 14.0 + 1.5 * 1.0 + 1.0 + 0.1, 13.6)  # past its margin
    assert not book.believed("y") and not book.believed("t0")  # 2 of 6 wrong: nobody's hints believed
    gone = Call("z", 0, "m1", 100, 10, 0.0, hints=Hints(calls_left=0))
    book.arrived(gone, None, 20.0, 13.6)
    book.finished(gone, 21.0)
    book.arrived(Call("w", 0, "m1", 100, 10, 0.0), None, 21.0 + 13.7, 13.6)  # z stayed away past the p90 gap
    assert book.sessions_checked == 7 and "z" not in book.ended
