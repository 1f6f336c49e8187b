"""The per-session floor (talaria_jax.sim.bounds): hand-computed on toy costs, and never beaten by
any policy on the default trace (kernel jitter off, so every chunk costs the model's nominal time)."""
import pytest

from talaria_jax.config_io import CONFIG_DIR
from talaria_jax.scheduler import POLICIES, get_policy
from talaria_jax.scheduler.session import Call
from talaria_jax.sim.bounds import sct_floor_s, service_floor_s
from talaria_jax.sim.cluster import replay
from talaria_jax.sim.cost import CostModel
from talaria_jax.sim.hardware import load_hardware, load_models
from talaria_jax.sim.toys import TOY_HW, TOY_SHAPES
from talaria_jax.sim.traces import TraceSpec, generate, read_jsonl

CALLS = read_jsonl(CONFIG_DIR / "traces" / "swebench-30x32.jsonl")
HW, SHAPES = load_hardware("h200x8"), load_models()
TOY = [Call("a", 0, "m1", 1000, 10, 5.0, 0.0), Call("a", 1, "m1", 1500, 10, 7.0)]


def test_floor_by_hand():
    # turn 0: prefill 1000 tokens = 2.002 s (tests/sim/test_sim_cost.py); 10 decode steps at context 1000
    # = 10 x (10 GB + 1 GB) / 100 GB/s = 1.1 s. Turn 1: 1010 tokens cached, 490 new:
    # (2e9 x 490 + 4 x 1000 x (1010 + 245) x 490) / 1e12 = 0.98246 s; 10 steps at 1500 = 1.15 s.
    svc = service_floor_s(TOY, CostModel(TOY_HW), TOY_SHAPES)
    assert svc == {"a": pytest.approx(2.002 + 1.1 + 0.98246 + 1.15)}
    assert sct_floor_s(TOY, CostModel(TOY_HW), TOY_SHAPES, {"a": 5.0})["a"] == pytest.approx(10.23446)


def test_a_session_alone_pays_only_its_switch_and_growing_context_above_the_floor():
    r = replay(TOY, get_policy("talaria"), TOY_HW, TOY_SHAPES, seed=0, jitter_sigma=0.0, gap_jitter_sigma=0.0)
    floor = sct_floor_s(TOY, CostModel(TOY_HW), TOY_SHAPES, r.tool_s)["a"]
    assert r.tool_s == {"a": 5.0}
    # the gap after a session's last turn is never waited, whatever order the calls come in
    assert replay(TOY[::-1], get_policy("talaria"), TOY_HW, TOY_SHAPES, seed=0, gap_jitter_sigma=0.0).tool_s == {"a": 5.0}
    # + the 1 s weight load of m1; decode chunks price each step at the chunk's mean context (+5 tokens
    # x 1 MB / 100 GB/s = 0.05 ms a step, 20 steps)
    assert r.sct_s["a"] - floor == pytest.approx(1.0 + 20 * 5e-5, abs=1e-3)


@pytest.mark.parametrize("name", list(POLICIES))
def test_no_policy_beats_the_floor_on_the_default_trace(name):
    r = replay(CALLS, get_policy(name), HW, SHAPES, seed=2, jitter_sigma=0.0)
    floor = sct_floor_s(CALLS, CostModel(HW), SHAPES, r.tool_s)
    assert set(floor) == set(r.sct_s)
    below = {s: (r.sct_s[s], f) for s, f in floor.items() if r.sct_s[s] < f - 1e-9}
    assert not below


def test_floor_caches_only_the_stated_prefix():
    # turn 1 compacts: of its 500-token prompt only the first 200 tokens are the earlier context
    calls = [TOY[0], Call("a", 1, "m1", 500, 10, 7.0, prefix_tokens=200)]
    cost = CostModel(TOY_HW)
    turn1 = cost.prefill_s(TOY_SHAPES["m1"], 300, 200) + 10 * cost.decode_step_s(TOY_SHAPES["m1"], 1, 500)
    assert service_floor_s(calls, cost, TOY_SHAPES)["a"] == pytest.approx(2.002 + 1.1 + turn1)


@pytest.mark.parametrize("name", ["talaria", "load"])
def test_no_policy_beats_the_floor_on_a_compacting_trace(name):
    calls = generate(TraceSpec(sessions=6, turns=40, compact_at_tokens=12000))
    assert sum(c.prefix_tokens is not None for c in calls) > 10
    r = replay(calls, get_policy(name), HW, SHAPES, seed=0, jitter_sigma=0.0)
    floor = sct_floor_s(calls, CostModel(HW), SHAPES, r.tool_s)
    assert all(r.sct_s[s] >= f - 1e-9 for s, f in floor.items())
