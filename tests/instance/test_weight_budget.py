"""An instance whose devices cannot hold every model: models keep arrays of their own and take turns under
a byte budget (`weight_budget_bytes`). A switch to an evicted model copies it from host memory (the
least recently used others evicted first), one still on the devices is free, staging starts the copy
early where the budget has room, and every call's tokens and logprobs equal those of an instance that
holds every model."""
import dataclasses
import gc
import weakref

import jax
import numpy as np
import pytest

from talaria_jax.engine.engine import Engine, EngineConfig, RequestError
from talaria_jax.engine.sampling import SamplingParams
from talaria_jax.instance import Instance, LiveTokens, resolve_weight_budget, shapes_of
from talaria_jax.models import init_model, load_model_config
from talaria_jax.scheduler.api import WeightState
from talaria_jax.scheduler.session import Call
from talaria_jax.sharding import make_mesh
from talaria_jax.sim.toys import TOY_HW
from talaria_jax.weights.budget import held_bytes

ENGINE = EngineConfig(page_size=8, max_seqs=4, max_tokens_per_step=64, max_model_len=256, num_pages=96, warmup=False)
GREEDY = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
SEEDED = SamplingParams(max_tokens=8, temperature=0.9, top_p=0.95, seed=5, ignore_eos=True)


@pytest.fixture(scope="module")
def models():
    """A and C of one shape, B smaller: a budget of A + B holds B beside either, never A beside C."""
    mesh = make_mesh(jax.devices()[:1])
    tiny = load_model_config("tiny-dense")
    small = dataclasses.replace(tiny, name="tiny-dense-2", num_layers=2, hidden_size=128)
    return {"A": init_model(tiny, mesh, seed=1), "B": init_model(small, mesh, seed=2),
            "C": init_model(tiny, mesh, seed=3)}


def instance(models, **kw) -> Instance:
    hw = dataclasses.replace(TOY_HW, num_gpus=1)
    return Instance("i0", models, hw, shapes_of(models, 1), engine_config=ENGINE, tokens=LiveTokens(), resident=True,
                    **kw)


@pytest.fixture(scope="module")
def budget(models) -> int:
    return held_bytes(models["A"]) + held_bytes(models["B"])


@pytest.fixture(scope="module")
def turns(models, budget):
    return instance(models, weight_budget_bytes=budget)


@pytest.fixture(scope="module")
def every_model(models):
    return instance(models)


def fresh(inst: Instance, staging: bool = False) -> Instance:
    inst.reset(host_kv=True, staging=staging, drop_kv_on_switch=False)
    inst.tokens = LiveTokens()
    return inst


def run(inst: Instance) -> None:
    while (end := inst.start_chunk(inst.now)) is not None:
        inst.finish_chunk(end)


def serve(inst: Instance, model: str, seed: int) -> tuple[list[int], list[float]]:
    """Switches to `model` (one chunk) and runs one greedy and one seeded call on it; their outputs."""
    inst.switch_model(model)
    end = inst.start_chunk(inst.now)
    assert inst.finish_chunk(end) == [] and inst.active_model() == model
    rng = np.random.default_rng(seed)
    calls = []
    for k, params in enumerate((GREEDY, SEEDED)):
        prompt = rng.integers(1, 250, 19 + 6 * k).tolist()
        c = Call(f"{model}{seed}-{k}", 0, model, len(prompt), params.max_tokens, 0.0, start_s=0.0)
        inst.tokens.begin(c, inst.served[model].engine.check_request(prompt, params), salt=None, single=True)
        inst.admit(c)
        calls.append(c)
    run(inst)
    return [(inst.outputs[c.key].token_ids, inst.outputs[c.key].logprobs) for c in calls]


def test_models_take_turns_under_the_budget_with_the_outputs_of_an_instance_holding_all(turns, every_model, budget):
    fresh(turns)
    fresh(every_model)
    w = turns.weights
    assert all(turns.weight_state(m) == WeightState.HOST for m in "ABC") and w.device_bytes() == 0
    assert turns.estimate_switch_s("A") > 0 and every_model.estimate_switch_s("A") == 0.0
    # A loads; C evicts A (A + C exceed the budget); B fits beside C; A evicts C, the least recently used
    expected = {"A": "A", "C": "C", "B": "BC", "A2": "AB"}
    for seed, (step, on) in enumerate(expected.items()):
        model = step[0]
        loads, switch_s = w.loads, turns.stats.switch_s
        got, want = serve(turns, model, seed), serve(every_model, model, seed)
        assert {m for m in "ABC" if turns.weight_state(m) != WeightState.HOST} == set(on), step
        assert w.device_bytes() <= budget
        assert w.loads == loads + 1 and turns.stats.switch_s > switch_s  # a real copy, timed
        for (toks, lps), (ref_toks, ref_lps) in zip(got, want):
            assert toks == ref_toks, step
            np.testing.assert_allclose(lps, ref_lps, rtol=1e-5, atol=1e-6)
    assert turns.weight_state("B") == WeightState.RESIDENT and turns.estimate_switch_s("B") == 0.0
    loads = w.loads
    serve(turns, "B", 9)  # on the devices still: nothing copied
    assert w.loads == loads and turns.weight_state("A") == WeightState.RESIDENT


def test_staging_copies_the_next_model_while_another_serves(turns):
    fresh(turns, staging=True)
    w = turns.weights
    serve(turns, "A", 0)
    assert turns.stage_model("B")  # fits beside A
    loads = w.loads
    assert turns.start_chunk(turns.now) is None  # nothing to run: the copy starts at this boundary
    assert w.loads == loads + 1 and turns.weight_state("B") in (WeightState.STAGING, WeightState.STAGED)
    serve(turns, "B", 1)
    assert w.loads == loads + 1 and turns.weight_state("A") == WeightState.RESIDENT  # the staged copy, A kept
    assert turns.stage_model("C")  # fits beside B once A, not active, is evicted
    turns.start_chunk(turns.now)
    assert turns.weight_state("A") == WeightState.HOST and w.loads == loads + 2


def test_a_budget_that_holds_every_model_is_no_budget(models, budget):
    """Where the budget holds every model at once nothing is ever evicted: no budget (None), so the
    instance keeps no host copy of the weights (one model under "largest", the serving default)."""
    a, b = held_bytes(models["A"]), held_bytes(models["B"])
    assert resolve_weight_budget("largest", {"A": models["A"]}) is None
    assert resolve_weight_budget("largest", models) == a
    assert resolve_weight_budget(str(budget), models) == budget
    assert resolve_weight_budget(str(2 * a + b), models) is None
    assert resolve_weight_budget("all", models) is None


def test_a_budget_too_small_or_without_own_arrays_is_refused(models):
    hw = dataclasses.replace(TOY_HW, num_gpus=1)
    with pytest.raises(ValueError, match=r"weight_budget_bytes \(1000\) is smaller than A's weights"):
        instance(models, weight_budget_bytes=1000)
    with pytest.raises(ValueError, match="weight_budget_bytes needs resident=True"):
        Instance("i0", models, hw, shapes_of(models, 1), engine_config=ENGINE, tokens=LiveTokens(),
                 weight_budget_bytes=10**9)


def test_an_engine_without_its_weights_refuses_to_step_until_they_are_placed(models):
    model = models["B"]
    eng = Engine(model, dataclasses.replace(ENGINE, num_pages=16))
    want = eng.generate([[1, 2, 3]], GREEDY)[0].token_ids
    eng.place_weights(None)
    with pytest.raises(ValueError, match="not on the devices"):
        eng.generate([[1, 2, 3]], GREEDY)
    assert not eng.has_unfinished()  # refused before anything was planned: nothing queued, nothing lost
    with pytest.raises(ValueError, match="does not match"):
        eng.place_weights(models["A"].state)
    eng.place_weights(jax.device_put(jax.device_get(model.state), jax.tree.map(lambda v: v.sharding, model.state)))
    assert eng.generate([[1, 2, 3]], GREEDY)[0].token_ids == want
    with pytest.raises(RequestError, match="an instance places this engine's weights"):
        eng.update_weights(model.state)  # the owner's host copy would be the old weights


def test_evicted_weights_leave_the_devices(models, budget):
    """Eviction frees the arrays a model was served from (no engine or runner keeps them)."""
    inst = fresh(instance(models, weight_budget_bytes=budget))
    serve(inst, "A", 0)
    placed = [weakref.ref(a) for a in jax.tree.leaves(inst.served["A"].engine.model.state)]
    serve(inst, "C", 1)  # evicts A
    gc.collect()
    assert inst.weight_state("A") == WeightState.HOST and not any(r() is not None for r in placed)
