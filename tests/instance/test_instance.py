"""Real instances (talaria_jax.instance): KV across model switches, stable addresses, tenant salts,
nothing lost when memory runs out, and every policy driving real instances."""
import dataclasses
import time
import warnings

import jax
import numpy as np
import pytest

from talaria_jax.engine.engine import EngineConfig
from talaria_jax.instance import Instance, SessionTokens, shapes_of
from talaria_jax.kvcache.pool import buffer_pointers
from talaria_jax.local import replay_local
from talaria_jax.models import init_model, load_model_config
from talaria_jax.models.model import forward
from talaria_jax.scheduler.api import WeightState
from talaria_jax.scheduler.policies import get_policy
from talaria_jax.scheduler.session import Call
from talaria_jax.sharding import make_mesh
from talaria_jax.sim.traces import TraceSpec, generate
from talaria_jax.sim.toys import TOY_HW

ENGINE = EngineConfig(page_size=8, max_seqs=4, max_tokens_per_step=64, max_model_len=256, num_pages=128, warmup=False)


def small(name: str, **kw):
    return dataclasses.replace(load_model_config(name), name=f"{name}-{kw.get('num_layers', 'x')}", **kw)


@pytest.fixture(scope="module")
def models4():
    """Two models of different shapes on one 4-device mesh (kv heads split, and replicated)."""
    mesh = make_mesh(jax.devices()[:4])
    return {"A": init_model(load_model_config("tiny-dense"), mesh, seed=1),
            "B": init_model(small("tiny-dense", num_layers=2, num_kv_heads=2, hidden_size=128), mesh, seed=2)}


def instance(models, tokens=None, name="i0", **kw) -> Instance:
    hw = dataclasses.replace(TOY_HW, num_gpus=models["A"].mesh.devices.size)
    return Instance(name, models, hw, shapes_of(models, hw.num_gpus), engine_config=kw.pop("engine", ENGINE),
                    tokens=tokens or SessionTokens(), **kw)


@pytest.fixture(scope="module")
def shared4(models4):
    """One instance for several tests (each resets it), so its step shapes compile once."""
    return instance(models4)


def fresh(inst: Instance, drop: bool = False, tokens: SessionTokens | None = None) -> Instance:
    inst.reset(host_kv=True, staging=True, drop_kv_on_switch=drop)
    inst.tokens = tokens or SessionTokens()
    return inst


def run(inst: Instance) -> list[Call]:
    """Runs chunks until the instance is idle; returns the calls that finished."""
    done = []
    while (end := inst.start_chunk(inst.now)) is not None:
        done += inst.finish_chunk(end)
    return done


def serve(inst: Instance, *calls: Call) -> None:
    """Switches to the calls' model when needed, admits them and runs them to completion."""
    if inst.active_model() != calls[0].model:
        inst.switch_model(calls[0].model)
        run(inst)
    for c in calls:
        inst.admit(c)
    assert {c.key for c in run(inst)} == {c.key for c in calls}


def recompute_logprobs(model, tokens: list[int], n_out: int) -> tuple[list[int], np.ndarray]:
    """Greedy tokens and their log-probabilities from a full forward of `tokens` (no cache)."""
    logits = np.asarray(forward(model, np.array([tokens], np.int32)))[0, len(tokens) - n_out - 1:len(tokens) - 1]
    logp = logits - np.log(np.exp(logits - logits.max(-1, keepdims=True)).sum(-1, keepdims=True)) - logits.max(-1, keepdims=True)
    return logits.argmax(-1).tolist(), logp


@pytest.mark.parametrize("drop", [False, True])
def test_session_kv_survives_a_to_b_to_a(models4, shared4, drop):
    # drop=True discards device KV at each switch, so the return must come from the host copy
    inst = fresh(shared4, drop=drop)
    s0 = Call("s", 0, "A", 40, 8, 1.0, start_s=0.0)
    serve(inst, s0)
    serve(inst, Call("o", 0, "B", 30, 8, 1.0, start_s=0.0))
    s1 = Call("s", 1, "A", 64, 10, 1.0)
    hist = len(inst.tokens.context("s", "A"))
    restored, hit = inst.stats.restored_tokens, inst.stats.device_hit_tokens
    serve(inst, s1)
    # every token of the history but the last (which had no KV yet) comes back: none is recomputed
    assert inst.stats.recomputed_tokens == 0
    assert inst.stats.restored_tokens - restored + inst.stats.device_hit_tokens - hit == hist - 1
    # without drop, A's full pages stayed cached on device and the host copy adds the partial last page
    assert inst.stats.device_hit_tokens - hit == (0 if drop else (hist - 1) // 8 * 8)
    out = inst.outputs[s1.key]
    tokens = list(out.prompt_token_ids) + out.token_ids
    greedy, logp = recompute_logprobs(models4["A"], tokens, len(out.token_ids))
    assert out.token_ids == greedy
    np.testing.assert_allclose(out.logprobs, logp[np.arange(len(greedy)), greedy], rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("drop", [False, True])
def test_a_session_that_uses_two_models_reuses_each_models_own_kv(models4, shared4, drop):
    """One session calls A, then B, then A again: the return to A reuses A's own KV (device pages, or
    the host copy when the switch dropped them) and B's call did not replace A's host copy; each call's
    tokens and logprobs are a full recompute's. A compaction on B then cuts what A may reuse."""
    inst = fresh(shared4, drop=drop)
    serve(inst, Call("s", 0, "A", 40, 8, 1.0, start_s=0.0))
    serve(inst, Call("s", 1, "B", 60, 8, 1.0))
    assert len(inst.tokens.context("s", "A")) == 48 and len(inst.tokens.context("s", "B")) == 68
    assert inst.cached_prefix("s", "A").host_tokens == 47 and inst.cached_prefix("s", "B").host_tokens == 67
    restored, hit = inst.stats.restored_tokens, inst.stats.device_hit_tokens
    a2 = Call("s", 2, "A", 90, 8, 1.0)
    serve(inst, a2)
    assert inst.stats.recomputed_tokens == 0
    assert inst.stats.restored_tokens - restored + inst.stats.device_hit_tokens - hit == 47  # all of A's but the last
    for call, model in ((a2, "A"), (Call("s", 1, "B", 60, 8, 1.0), "B")):
        out = inst.outputs[call.key]
        greedy, logp = recompute_logprobs(models4[model], list(out.prompt_token_ids) + out.token_ids, len(out.token_ids))
        assert out.token_ids == greedy
        np.testing.assert_allclose(out.logprobs, logp[np.arange(len(greedy)), greedy], rtol=1e-5, atol=1e-6)
    serve(inst, Call("s", 3, "B", 50, 8, 1.0, prefix_tokens=20))  # B compacts: a new prefix past 20 tokens
    assert len(inst.tokens.context("s", "A")) == 20 and inst.cached_prefix("s", "A").host_tokens == 20
    a4 = Call("s", 4, "A", 80, 8, 1.0)
    serve(inst, a4)
    prompt = inst.outputs[a4.key].prompt_token_ids
    assert list(prompt[:20]) == list(inst.outputs[a2.key].prompt_token_ids[:20])
    assert list(prompt[20:40]) != list(inst.outputs[a2.key].prompt_token_ids[20:40])  # not A's old context
    assert inst.outputs[a4.key].cached_tokens <= 20


def test_resident_models_switch_without_moving_weights(models4):
    # resident=True (a CPU): each model keeps its own arrays, no slot; a switch moves nothing, costs
    # nothing in the scheduler's estimate, and the session's tokens are still the model's own
    inst = instance(models4, resident=True)
    assert inst.slot is None and inst.estimate_switch_s("B") == 0.0
    assert not inst.stage_model("B") or inst.weight_state("B") == WeightState.RESIDENT
    serve(inst, Call("s", 0, "A", 40, 8, 1.0, start_s=0.0))
    serve(inst, Call("o", 0, "B", 30, 8, 1.0, start_s=0.0))
    s1 = Call("s", 1, "A", 64, 10, 1.0)
    serve(inst, s1)
    assert inst.stats.switches == 3 and inst.stats.recomputed_tokens == 0
    assert inst.weight_state("A") == WeightState.ACTIVE and inst.estimate_switch_s("B") == 0.0
    out = inst.outputs[s1.key]
    greedy, _ = recompute_logprobs(models4["A"], list(out.prompt_token_ids) + out.token_ids, len(out.token_ids))
    assert out.token_ids == greedy


def test_a_replay_clock_leaves_out_compiling(models4):
    # step shapes no other test meets (40 tokens a step), so the first chunks compile: the instance's
    # clock advances by the steps' seconds without the compiling, which stats.compile_s counts
    inst = instance(models4, engine=dataclasses.replace(ENGINE, max_tokens_per_step=40), resident=True,
                    exclude_compiles=True)
    t = time.perf_counter()
    serve(inst, Call("s", 0, "A", 30, 4, 1.0, start_s=0.0))
    wall = time.perf_counter() - t
    assert inst.stats.compile_s > 0.05
    assert inst.now + inst.stats.compile_s <= wall


def test_slot_and_pool_addresses_stay_put_over_20_switches(shared4):
    inst = fresh(shared4)
    pools = {m: buffer_pointers(s.engine.runner.kv) for m, s in inst.served.items()}
    assert len({tuple(p) for p in pools.values()}) == 1  # one KV arena for both models
    assert inst.kv_pages_total() == inst.arena.num_pages == inst.served["A"].engine.allocator.num_pages
    slot = inst.slot.pointers()
    turn = {"A": 0, "B": 0}
    with warnings.catch_warnings():
        warnings.filterwarnings("error", message="Some donated buffers were not usable")
        for k in range(20):
            m = "AB"[k % 2]
            if k % 4 == 1:  # half the switches come from the staging area
                assert inst.stage_model(m)
                run(inst)
                assert inst.weight_state(m) in (WeightState.STAGED, WeightState.STAGING)
            c = Call(f"s{m}", turn[m], m, 24 + 16 * turn[m], 4, 1.0, start_s=0.0 if turn[m] == 0 else None)
            turn[m] += 1
            serve(inst, c)
    assert inst.stats.switches == 20 and inst.stats.restored_tokens + inst.stats.device_hit_tokens > 0
    assert inst.slot.pointers() == slot
    assert {m: buffer_pointers(s.engine.runner.kv) for m, s in inst.served.items()} == pools


def test_tenant_salt_decides_prefix_sharing(shared4):
    # every session starts with the same 32-token system prompt; the tenant is the id's prefix
    inst = fresh(shared4, tokens=SessionTokens(shared_prefix=32, tenant=lambda sid: sid.split(":")[0]))
    serve(inst, Call("t1:a", 0, "A", 48, 4, 1.0, start_s=0.0))
    hit = inst.stats.device_hit_tokens
    serve(inst, Call("t1:b", 0, "A", 48, 4, 1.0, start_s=0.0))  # same tenant: the system prompt is a hit
    assert inst.stats.device_hit_tokens - hit == 32
    hit = inst.stats.device_hit_tokens
    serve(inst, Call("t2:c", 0, "A", 48, 4, 1.0, start_s=0.0))  # another tenant: nothing shared
    assert inst.stats.device_hit_tokens == hit


def _trace(models, seed=0):
    return generate(TraceSpec(sessions=6, turns=3, models=models, arrival_rate_per_s=4.0, system_tokens=(24, 60),
                              obs_median_tokens=12.0, obs_max_tokens=32, output_mean_tokens=6.0, output_range=(3, 10),
                              max_context_tokens=150, seed=seed))


@pytest.fixture(scope="module")
def models1():
    mesh = make_mesh(jax.devices()[:1])
    return {"A": init_model(load_model_config("tiny-dense"), mesh, seed=1),
            "B": init_model(small("tiny-dense", num_layers=2), mesh, seed=2)}


def test_nothing_lost_when_device_and_host_memory_run_out(models1):
    # Three sessions of A at once, then of B, then each one's next turn, admitted past the scheduler's
    # admission control: 9 pages of 8 tokens per model hold fewer than the running calls need, so the
    # engine preempts; a host budget below one session's KV keeps no host copy, so returns recompute.
    def serve_all(inst):
        for turn, prompt in ((0, 30), (1, 52)):
            for m in "AB":
                serve(inst, *[Call(f"{m}{k}", turn, m, prompt + 3 * k, 8, 1.0, start_s=0.0 if turn == 0 else None)
                              for k in range(3)])
        return inst.tokens.history

    want = serve_all(instance(models1))
    tight = instance(models1, engine=dataclasses.replace(ENGINE, num_pages=9), host_kv_bytes=4096)
    assert serve_all(tight) == want  # every call produced the greedy tokens it had with room
    engines = [s.engine for s in tight.served.values()]
    assert sum(e.stats.preemptions for e in engines) > 0
    assert sum(e.stats.offload_failures for e in engines) > 0 and tight.stats.restored_tokens == 0
    assert tight.stats.recomputed_tokens > 0


@pytest.fixture(scope="module")
def pair():
    """Two one-device instances hosting the same two models (for every policy: each replay resets them)."""
    tokens = SessionTokens()
    out = []
    for k in (0, 1):
        mesh = make_mesh(jax.devices()[k:k + 1])
        models = {"A": init_model(load_model_config("tiny-dense"), mesh, seed=1),
                  "B": init_model(small("tiny-dense", num_layers=2), mesh, seed=2)}
        out.append(instance(models, tokens=tokens, name=f"i{k}"))
    return out


@pytest.fixture(scope="module")
def round_history(pair):
    replay_local(_trace(("A", "B"), seed=1), get_policy("round"), pair)
    return dict(pair[0].tokens.history)


@pytest.mark.parametrize("policy", ["talaria", "load", "sticky", "composite", "talaria-popular-first"])
def test_every_policy_drives_real_instances(pair, round_history, policy):
    calls = _trace(("A", "B"), seed=1)
    res = replay_local(calls, get_policy(policy), pair)
    assert len(res.records) == len(calls) and len(res.sct_s) == 6
    assert sum(i.stats.switches for i in pair) >= 2
    # greedy outputs depend only on each session's tokens: KV restored, reused or recomputed, every policy
    # must produce the same sessions, token for token
    assert pair[0].tokens.history == round_history


def test_a_refused_call_leaves_with_its_error_and_the_rest_are_served(shared4):
    from talaria_jax.engine.errors import RequestError

    inst = fresh(shared4)
    inst.switch_model("A")
    run(inst)
    too_long = Call("x", 0, "A", 300, 4, 1.0, start_s=0.0)  # max_model_len is 256
    ok = Call("y", 0, "A", 20, 4, 1.0, start_s=0.0)
    inst.admit(too_long)
    inst.admit(ok)
    with pytest.raises(RequestError, match="exceeds the context limit of 256"):
        inst.start_chunk(inst.now)
    assert [c.key for c in run(inst)] == [ok.key] and inst.num_waiting() == 0


def test_compacted_prompt_keeps_its_prefix_then_new_tokens():
    tokens = SessionTokens()
    p0 = tokens.prompt(Call("s", 0, "A", 10, 4, 0.0, 0.0), 1000)
    tokens.finished(Call("s", 0, "A", 10, 4, 0.0, 0.0), tuple(p0), [1, 2, 3, 4])
    grown = tokens.prompt(Call("s", 1, "A", 20, 4, 0.0), 1000)
    assert grown[:14] == p0 + [1, 2, 3, 4]
    compact = tokens.prompt(Call("s", 1, "A", 12, 4, 0.0, prefix_tokens=6), 1000)
    assert len(compact) == 12 and compact[:6] == p0[:6] and compact[6:10] != p0[6:10]  # a summary, not the old context
