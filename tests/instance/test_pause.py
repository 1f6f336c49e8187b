"""Token-level preemption across models on a real instance: a switch pauses the active model's calls
in flight, another model's calls run, and the paused calls resume with nothing lost: the same tokens
and logprobs as a run without the pause, whether their KV stayed on device or went to host memory
and came back."""
import dataclasses

import jax
import numpy as np
import pytest

from talaria_jax.engine.engine import EngineConfig
from talaria_jax.engine.sampling import SamplingParams
from talaria_jax.instance import Instance, LiveTokens, SessionTokens, shapes_of
from talaria_jax.local import replay_local
from talaria_jax.models import init_model, load_model_config
from talaria_jax.scheduler.policies import get_policy
from talaria_jax.scheduler.session import Call
from talaria_jax.sharding import make_mesh
from talaria_jax.sim.toys import TOY_HW

ENGINE = EngineConfig(page_size=8, max_seqs=4, max_tokens_per_step=64, max_model_len=256, num_pages=96, warmup=False)
GREEDY = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)
SEEDED = SamplingParams(max_tokens=16, temperature=0.9, top_p=0.95, seed=11, ignore_eos=True)


@pytest.fixture(scope="module")
def inst():
    """Three models of two shapes on one device, through one weight slot (not resident)."""
    mesh = make_mesh(jax.devices()[:1])
    tiny = load_model_config("tiny-dense")
    other = dataclasses.replace(tiny, name="tiny-dense-2", num_layers=2, hidden_size=128)
    models = {"A": init_model(tiny, mesh, seed=1), "B": init_model(other, mesh, seed=2),
              "C": init_model(tiny, mesh, seed=3)}
    hw = dataclasses.replace(TOY_HW, num_gpus=1)
    return Instance("i0", models, hw, shapes_of(models, 1), engine_config=ENGINE, tokens=LiveTokens())


def fresh(inst: Instance) -> Instance:
    inst.reset(host_kv=True, staging=False, drop_kv_on_switch=False)
    inst.tokens = LiveTokens()
    return inst


def call(inst: Instance, session: str, model: str, prompt: list[int], params: SamplingParams) -> Call:
    c = Call(session, 0, model, len(prompt), params.max_tokens, 0.0, start_s=0.0)
    inst.tokens.begin(c, inst.served[model].engine.check_request(prompt, params), salt=None, single=True)
    return c


def chunk(inst: Instance) -> list[Call]:
    end = inst.start_chunk(inst.now)
    return [] if end is None else inst.finish_chunk(end)


def run(inst: Instance) -> list[Call]:
    done = []
    while (end := inst.start_chunk(inst.now)) is not None:
        done += inst.finish_chunk(end)
    return done


def switch(inst: Instance, model: str, pause: bool = False) -> None:
    inst.switch_model(model, pause=pause)
    assert chunk(inst) == [] and inst.active_model() == model


def prompts(seed: int) -> tuple[list[int], list[int]]:
    rng = np.random.default_rng(seed)
    return rng.integers(1, 250, 37).tolist(), rng.integers(1, 250, 21).tolist()


def a_calls(inst: Instance) -> list[Call]:
    p1, p2 = prompts(0)
    return [call(inst, "a-greedy", "A", p1, GREEDY), call(inst, "a-seeded", "A", p2, SEEDED)]


@pytest.fixture(scope="module")
def uninterrupted(inst):
    """A's two calls, run from start to end with nothing in between."""
    fresh(inst)
    switch(inst, "A")
    calls = a_calls(inst)
    for c in calls:
        inst.admit(c)
    run(inst)
    return {c.session: inst.outputs[c.key] for c in calls}


@pytest.mark.parametrize("released", [None, "device", "host", "host-only"])
def test_paused_calls_resume_as_if_uninterrupted(inst, uninterrupted, released):
    """A's calls run a few steps (their KV ends mid-page), B's and C's calls are served in between (two
    switches away from A), then A's resume: their KV kept in their pages; released to the prefix
    cache (its full pages) and recomputed past them; released with a host copy, which tops up what
    the cache keeps; or restored from the host copy alone, the device copy gone."""
    fresh(inst)
    switch(inst, "A")
    calls = a_calls(inst)
    for c in calls:
        inst.admit(c)
    for _ in range(3):  # a prefill, then decode steps: 37 + 2 and 21 + 2 tokens computed, mid-page
        assert chunk(inst) == []
    with pytest.raises(RuntimeError, match="pause=True"):
        inst.switch_model("B")
    switch(inst, "B", pause=True)
    assert {c.key for c in inst.paused()} == {c.key for c in calls}
    a_stats, allocator = inst.served["A"].engine.stats, inst.arena.allocator
    preempted, offloaded, free = a_stats.preemptions, a_stats.offloaded_tokens, allocator.num_free
    if released is not None:
        assert inst.release_paused("A", to_host=released.startswith("host")) == 2
        assert a_stats.preemptions == preempted + 2 and allocator.num_free > free  # their partial pages
        assert (a_stats.offloaded_tokens - offloaded) == (39 + 23 if released.startswith("host") else 0)
    b = call(inst, "b", "B", prompts(1)[0], SEEDED)
    inst.admit(b)
    assert [c.key for c in run(inst)] == [b.key]  # A's calls wait: their engine is not stepped
    switch(inst, "C")
    c1 = call(inst, "c", "C", prompts(2)[1], GREEDY)
    inst.admit(c1)
    assert [c.key for c in run(inst)] == [c1.key]
    if released == "host-only":
        inst.served["A"].engine.clear_prefix_cache()  # the device copy is gone: the host copy restores
    restored, hits = inst.stats.restored_tokens, a_stats.prefix_hit_tokens
    switch(inst, "A")
    assert {c.key for c in run(inst)} == {c.key for c in calls} and not inst.paused()
    # from the cache: the full pages (32 + 16 tokens); from host: the rest, or all of it
    assert a_stats.prefix_hit_tokens - hits == (0 if released in (None, "host-only") else 32 + 16)
    assert inst.stats.restored_tokens - restored == {"host": 7 + 7, "host-only": 39 + 23}.get(released, 0)
    for c in calls:
        out, ref = inst.outputs[c.key], uninterrupted[c.session]
        assert out.token_ids == ref.token_ids, c.session
        np.testing.assert_allclose(out.logprobs, ref.logprobs, rtol=1e-5, atol=1e-6)
        assert out.cached_tokens == ref.cached_tokens  # what the first admission found: the prompt's


def test_a_switch_waits_for_admitted_calls_and_only_paused_models_release(inst):
    fresh(inst)
    switch(inst, "A")
    calls = a_calls(inst)
    inst.admit(calls[0])
    with pytest.raises(RuntimeError, match="admitted but not started"):
        inst.switch_model("B", pause=True)
    with pytest.raises(RuntimeError, match="A is active"):
        inst.release_paused("A")
    run(inst)


def test_the_scheduler_pauses_a_real_instance_and_loses_nothing(inst):
    """The talaria policy pauses A's long call for a short session of B (slots cut short so the pause
    is decided within a few steps); every call's greedy tokens and logprobs equal a replay where
    nothing is paused."""
    calls = [Call("long", 0, "A", 40, 150, 0.0, 0.0), Call("short", 0, "B", 24, 6, 0.0, 0.02)]
    out = {}
    for name in ("talaria", "talaria-no-preempt"):
        inst.tokens = SessionTokens()
        res = replay_local(calls, get_policy(f"{name}[slot_s=0.01;min_slot_s=0]"), [inst])
        out[name] = ({r.session: r.done_s for r in res.records}, inst.stats.pauses, inst.stats.switch_log,
                     dict(inst.outputs))
    (done, pauses, _, paused), (_, pauses0, _, ref) = out["talaria"], out["talaria-no-preempt"]
    assert pauses == 1 and pauses0 == 0
    assert done["short"] < done["long"]  # it went past the long call
    for key, o in ref.items():
        assert paused[key].token_ids == o.token_ids, key
        np.testing.assert_allclose(paused[key].logprobs, o.logprobs, rtol=1e-5, atol=1e-6)
