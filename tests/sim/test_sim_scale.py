"""The replay's event loop scales with the calls, not calls x servers: each instance is planned only
on its own events, a decode chunk is cut only by an arrival routed to its own instance, and the
router's index and SimInstance's cached figures give exactly what the plain computations give."""
import copy

import pytest

from talaria_jax.scheduler import Call, Scheduler, get_policy
from talaria_jax.sim import cluster
from talaria_jax.sim.hardware import load_hardware, load_models
from talaria_jax.sim.instance import SimInstance
from talaria_jax.sim.toys import TOY_HW, TOY_SHAPES
from talaria_jax.sim.traces import TraceSpec, generate

HW, SHAPES = load_hardware("h200x8"), load_models()
MODELS = ("qwen3-235b-a22b", "glm-4.5-fp8", "llama-3.1-405b-fp8", "qwen3-235b-a22b-fp8", "glm-4.5-air-fp8",
          "gpt-oss-120b")  # the cluster trace's six
# 8 servers at the cluster trace's load per server (0.5 sessions/s each), short sessions
CALLS = generate(TraceSpec(sessions=48, turns=6, arrival_rate_per_s=4.0, models=MODELS, seed=3))


def test_chunks_and_plans_per_call_stay_small_on_many_servers(monkeypatch):
    # Cutting every instance's decode chunk at every event anywhere in the cluster, and planning
    # every idle instance after every event, gave 54-73 chunks per call on 2+ servers (4 on one) and
    # plans ~ events x servers. Now an instance is planned only at its chunk ends, at arrivals routed
    # to it while idle (or releasing a reservation it holds) and at its own wakes.
    plans: dict[str, int] = {}
    real_plan = Scheduler.plan

    def counting_plan(self, inst, now):
        plans[inst.name] = plans.get(inst.name, 0) + 1
        return real_plan(self, inst, now)

    monkeypatch.setattr(Scheduler, "plan", counting_plan)
    res = cluster.replay(CALLS, get_policy("talaria"), HW, SHAPES, servers=8, seed=0)
    s = res.summary()
    assert s["calls"] == len(CALLS)
    assert s["chunks_per_call"] < 6
    chunks = sum(i.stats.chunks for i in res.instances)
    arrivals: dict[str, int] = {}
    for r in res.records:
        arrivals[r.instance] = arrivals.get(r.instance, 0) + 1
    for inst in res.instances:
        # a plan per chunk end, and at most one per arrival routed here plus one per arrival that
        # released a reservation held here, plus wakes (few)
        assert plans.get(inst.name, 0) <= inst.stats.chunks + 2 * arrivals.get(inst.name, 0) + 20, inst.name
    assert sum(plans.values()) < chunks + 2 * len(CALLS)


def _decoding(horizon):
    """A toy instance 2 calls into a decode run from t=0 (nothing staged, no jitter)."""
    inst = SimInstance("i", TOY_HW, TOY_SHAPES, ("m1",), host_kv=True, staging=False, drop_kv_on_switch=False,
                       page_bytes=1_000_000)
    inst.switch_model("m1")
    t = inst.start_chunk(0.0)
    inst.finish_chunk(t)
    inst.admit(Call("a", 0, "m1", 100, 50, 0.0, 0.0))
    inst.admit(Call("b", 0, "m1", 200, 50, 0.0, 0.0))
    t = inst.start_chunk(t)  # the prefill of both
    inst.finish_chunk(t)
    return inst, t, inst.start_chunk(t, horizon)


def test_truncating_a_decode_chunk_is_starting_it_with_that_horizon():
    long_inst, t0, long_end = _decoding(None)  # all 50 steps in one chunk
    assert long_inst.chunk.steps == 50
    for frac in (0.0, 0.013, 0.3, 0.5, 0.97):
        at = t0 + frac * (long_end - t0)
        cut = copy.deepcopy(long_inst)
        new_end = cut.truncate_chunk(at)
        ref, _, ref_end = _decoding(at)
        assert new_end == pytest.approx(ref_end, abs=1e-12) and new_end >= at
        assert cut.chunk == ref.chunk and cut.busy_until == new_end
        k = ref.chunk.steps
        assert cut.finish_chunk(new_end) == ref.finish_chunk(ref_end) == []  # nobody finished early
        assert [r.remaining for r in cut.running] == [r.remaining for r in ref.running] == [50 - k] * 2
    # past the chunk's end, or at its last step, nothing changes
    assert copy.deepcopy(long_inst).truncate_chunk(long_end) is None
    assert copy.deepcopy(long_inst).truncate_chunk(long_end - 1e-6) is None


def test_route_index_places_every_call_where_ranking_every_instance_would():
    for name in ("talaria", "composite", "sticky", "load", "talaria-smith", "talaria-popular-first"):
        a = cluster.replay(CALLS, get_policy(name), HW, SHAPES, servers=8, seed=1, indexed=True)
        b = cluster.replay(CALLS, get_policy(name), HW, SHAPES, servers=8, seed=1, indexed=False)
        assert [(r.session, r.turn, r.instance, r.done_s) for r in a.records] == \
            [(r.session, r.turn, r.instance, r.done_s) for r in b.records], name


class _Checked(SimInstance):
    """A SimInstance whose cached figures are checked against plain sums whenever they are read."""

    def kv_pages_used(self):
        v = super().kv_pages_used()
        assert v == self._kv_pages_used_slow()
        return v

    def kv_pages_reserved(self, exclude_session=None):
        v = super().kv_pages_reserved(exclude_session)
        assert v == self._kv_pages_reserved_slow(exclude_session)
        return v

    def device_bytes(self):
        assert self._kv_dev_pages() == self._kv_dev_pages_slow()
        assert self._host_bytes == sum(t * self.shapes[m].kv_bytes_per_token for m, t in self.kv_host.values())
        return super().device_bytes()


@pytest.mark.parametrize("name", ["talaria", "composite"])
def test_cached_kv_figures_equal_the_plain_sums(monkeypatch, name):
    monkeypatch.setattr(cluster, "SimInstance", _Checked)
    res = cluster.replay(CALLS[:120], get_policy(name), HW, SHAPES, servers=3, seed=0)
    assert all(isinstance(i, _Checked) for i in res.instances) and len(res.records) == 120
