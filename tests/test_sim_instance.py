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
