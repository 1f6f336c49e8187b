"""SimInstance memory accounting and eviction on hand-computable toys (talaria_jax.sim.toys: 30 GB of
HBM, 10 GB models, 1 MB of KV per token; pages of 1 MB here so tokens and pages coincide)."""
from talaria_jax.scheduler.api import WeightState
from talaria_jax.scheduler.session import Call
from talaria_jax.sim.instance import SimInstance
from talaria_jax.sim.toys import TOY_HW, TOY_SHAPES


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
