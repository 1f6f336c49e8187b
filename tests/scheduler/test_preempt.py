"""Token-level preemption across models in the scheduler (``PolicyConfig.preempt``), on the
simulator: once the active model's slot is over, its running calls pause for the next model's
waiting calls when that gains the waiting sessions more than it costs the paused ones, and resume
right after, drained without another pause."""
import dataclasses

import pytest

from talaria_jax.scheduler.policies import get_policy
from talaria_jax.scheduler.session import Call
from talaria_jax.sim.cluster import replay
from talaria_jax.sim.instance import SimInstance
from talaria_jax.sim.toys import TOY_HW, TOY_SHAPES, toy_model

# On the toy hardware a decode step of m1 takes 0.1 s (10 GB of weights at 100 GB/s): the long call
# runs ~20 s; a switch to a model on host loads 10 GB at 10 GB/s (1 s).
LONG = Call("long", 0, "m1", 1000, 200, 0.0, 0.0)


def short(sid: str, at: float) -> Call:
    return Call(sid, 0, "m2", 100, 5, 0.0, at)


def done(calls, policy: str):
    res = replay(calls, get_policy(policy), TOY_HW, TOY_SHAPES, seed=0, jitter_sigma=0, gap_jitter_sigma=0)
    return {r.session: r.done_s for r in res.records}, res.instances[0].stats


def test_a_short_session_passes_a_long_call_by_a_pause():
    calls = [LONG, short("s", 0.5)]
    t, st = done(calls, "talaria")
    t0, st0 = done(calls, "talaria-no-preempt")
    assert st0.pauses == 0 and t0["s"] > t0["long"]  # without: the short call waits for the drain
    assert st.pauses == 1 and [m for _, m, _ in st.switch_log] == ["m1", "m2", "m1"]
    assert t["s"] < 0.6 * t0["s"]  # it ends ~10 s sooner
    # the long call lost the two switches and the short call's work (about 1.7 s), nothing more
    assert 0 < t["long"] - t0["long"] < 2.5


def test_no_pause_for_a_call_longer_than_the_drain():
    """The waiting call would hold the long call's session back longer than it waits for the drain."""
    t, st = done([LONG, Call("s", 0, "m2", 100, 150, 0.0, 0.5)], "talaria")
    assert st.pauses == 0 and t["s"] > t["long"]


def test_resumed_calls_drain_without_another_pause():
    calls = [LONG, short("s", 0.5), short("late", 13.0)]  # "late" waits while the long call resumes
    t, st = done(calls, "talaria")
    assert st.pauses == 1 and t["s"] < 13.0 < t["long"] < t["late"]


def test_a_sim_pause_keeps_the_paused_kv_and_resumes_the_calls():
    inst = SimInstance("i0", TOY_HW, TOY_SHAPES, ("m1", "m2"), host_kv=True, staging=False, drop_kv_on_switch=False)

    def step():
        end = inst.start_chunk(inst.now)
        return inst.finish_chunk(end)

    inst.switch_model("m1")
    step()
    inst.admit(LONG)
    step()  # the prefill
    used, steps = inst.kv_pages_used(), inst.drain_s()
    assert steps == pytest.approx(200 * inst.cost.decode_step_s(TOY_SHAPES["m1"], 1, 1000 + 200 // 2), rel=1e-9)
    with pytest.raises(RuntimeError, match="pause=True"):
        inst.switch_model("m2")
    cost = inst.pause_cost_s("m2", inst.pages_for("m2", 105))
    assert cost == pytest.approx(inst.cost.weight_load_s(TOY_SHAPES["m2"]))  # both fit: no reload back
    inst.switch_model("m2", pause=True)
    assert inst.num_paused() == inst.num_running() == 1 and inst.drain_s() == 0.0
    step()
    assert inst.active_model() == "m2" and inst.kv_pages_used() == used  # the paused KV stays on device
    inst.switch_model("m1")  # nothing of m2 runs: a plain switch back
    step()
    assert inst.num_paused() == 0 and inst.drain_s() == pytest.approx(steps)
    finished = []
    while not finished:
        finished = step()
    assert finished == [LONG] and inst.stats.pauses == 1


def test_sleep_mode_pauses_nothing():
    inst = SimInstance("i0", TOY_HW, TOY_SHAPES, ("m1", "m2"), host_kv=False, staging=False, drop_kv_on_switch=True)
    inst.switch_model("m1")
    inst.finish_chunk(inst.start_chunk(0.0))
    inst.admit(LONG)
    inst.finish_chunk(inst.start_chunk(inst.now))
    with pytest.raises(RuntimeError, match="sleep mode"):
        inst.switch_model("m2", pause=True)


def test_policy_round_does_not_pause_and_sleep_mode_refuses_pauses():
    assert not get_policy("round").preempt and get_policy("talaria").preempt
    with pytest.raises(ValueError, match="drop_kv_on_switch=True discards"):
        dataclasses.replace(get_policy("talaria"), drop_kv_on_switch=True)


def test_a_pause_slot_is_not_renewed_while_its_model_keeps_arriving():
    """Sessions of the other model keep arriving during the pause: its slot still ends on time (no
    renewal, no hold), and the paused call resumes; the newcomers wait for its drain."""
    calls = [LONG] + [Call(f"s{k:02d}", t, "m2", 100 + 50 * t, 5, 0.0, 0.5 * k if t == 0 else None)
                      for k in range(1, 40) for t in range(3)]
    t, st = done(calls, "talaria")
    t0, _ = done(calls, "talaria-no-preempt")
    log = [(s, m) for s, m, _ in st.switch_log]
    k = [m for _, m in log].index("m2")
    assert st.pauses == 1 and log[k + 1][1] == "m1"
    # back within the waiting calls' batch and the switches; renewed, the pause lasted 17.8 s
    assert log[k + 1][0] - log[k][0] < 6.0
    assert t["long"] - t0["long"] < 6.0


def test_no_pause_where_the_switch_cannot_fit_beside_the_paused_kv():
    """A staged model's weights and the paused call's KV leave no room for the waiting model's."""
    shapes = {**TOY_SHAPES, "big": toy_model("big", weights_gb=17.0)}
    inst = SimInstance("i0", TOY_HW, shapes, ("m1", "big", "m3"), host_kv=True, staging=True, drop_kv_on_switch=False)
    inst.switch_model("m1")
    inst.finish_chunk(inst.start_chunk(0.0))
    inst.admit(Call("a", 0, "m1", 3500, 100, 0.0, 0.0))
    inst.finish_chunk(inst.start_chunk(inst.now))
    assert inst.stage_model("m3")
    assert inst.pause_cost_s("big", inst.pages_for("big", 105)) == float("inf")
    assert inst.pause_cost_s("m3", inst.pages_for("m3", 105)) < float("inf")  # the staged one itself fits
