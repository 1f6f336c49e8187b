"""`InstanceEngine`: an Instance of two models under the scheduler, stepped as an engine. Requests of
both models are served with the greedy tokens of each model alone; the probe counts the cached tokens
of a prompt per tenant; an abort frees its pages; idle sessions are forgotten."""
import jax
import pytest

from talaria_jax.engine.engine import EngineConfig
from talaria_jax.engine.errors import RequestError
from talaria_jax.engine.sampling import SamplingParams
from talaria_jax.instance import build_instances
from talaria_jax.models import greedy_generate
from talaria_jax.scheduler import Hints
from talaria_jax.scheduler.policies import get_policy
from talaria_jax.serve.instance_engine import InstanceEngine
from talaria_jax.sim.hardware import load_hardware
from talaria_jax.weights import load_model
from talaria_jax.sharding import make_mesh

CONFIG = EngineConfig(page_size=8, max_seqs=4, max_tokens_per_step=64, max_model_len=256, prefix_cache=True,
                      warmup=False)
GREEDY = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module")
def ie():
    [inst] = build_instances(["tiny-dense", "tiny-moe"], load_hardware("cpu"), instances=1, engine_config=CONFIG,
                             tokens=None, kv_bytes_per_device=4 << 20)
    return InstanceEngine(inst, get_policy("talaria"))


def run(ie, rids):
    outs = {}
    for _ in range(500):
        if not ie.has_unfinished():
            break
        for out in ie.step():
            outs.setdefault(out.request_id, []).extend(out.new_token_ids)
    assert not ie.has_unfinished()
    return {r: outs[r] for r in rids}


def test_both_models_are_served_with_their_own_greedy_tokens(ie):
    ie.reset(get_policy("talaria"))
    prompts = {"tiny-dense": [5, 6, 7, 8, 9] * 4, "tiny-moe": [3, 1, 4, 1, 5] * 4}
    rids = {m: ie.add_request(p, GREEDY, model=m, cache_salt="t", session=f"s-{m}") for m, p in prompts.items()}
    got = run(ie, list(rids.values()))
    mesh = make_mesh(jax.devices()[:1])
    for m, p in prompts.items():
        assert got[rids[m]] == greedy_generate(load_model(m, mesh).model, [p], 6)[0]
    assert ie.state()["switches"] >= 2
    with pytest.raises(RequestError, match="not served here"):
        ie.add_request([1, 2], GREEDY, model="gpt-9")
    with pytest.raises(RequestError, match="context limit"):
        ie.add_request([1] * 300, GREEDY, model="tiny-dense")
    assert not ie.requests  # refused requests left nothing behind


def test_probe_counts_a_prompts_cached_tokens_per_tenant(ie):
    ie.reset(get_policy("talaria"))
    prompt = list(range(10, 30))
    run(ie, [ie.add_request(prompt, GREEDY, model="tiny-dense", cache_salt="a", session="s")])
    out = list(ie.instance.tokens.context("s", "tiny-dense")[len(prompt):])
    follow = prompt + out + [1, 2, 3]
    assert ie.prefix_of("s", "tiny-dense", follow, "a").host_tokens == len(prompt) + 6 - 1  # all but the last
    # a prompt that diverges from the copy (a template re-rendering the reply): the common prefix counts
    diverged = prompt + [(out[0] + 1) % 256, 1, 2]
    mine = ie.prefix_of("s", "tiny-dense", diverged, "a")
    assert mine.host_tokens == len(prompt)
    assert ie.prefix_of("s", "tiny-dense", follow, "b") == type(mine)()  # another tenant: nothing


def test_a_live_session_on_two_models_keeps_each_models_kv(ie):
    """A session calls tiny-dense, then tiny-moe, then tiny-dense again: tiny-moe's call keeps its own
    history and host copy, so the return to tiny-dense finds all of its own context but the last token
    (device pages and host copy), and the scheduler expects the session back on the model it used last."""
    ie.reset(get_policy("talaria"))
    prompt = list(range(10, 30))
    run(ie, [ie.add_request(prompt, GREEDY, model="tiny-dense", cache_salt="a", session="s")])
    other = [7] * 12
    run(ie, [ie.add_request(other, GREEDY, model="tiny-moe", cache_salt="a", session="s")])
    assert ie.sessions.sessions["s"].model == "tiny-moe"
    out = list(ie.instance.tokens.context("s", "tiny-dense")[len(prompt):])
    follow = prompt + out + [1, 2, 3]
    assert ie.prefix_of("s", "tiny-dense", follow, "a").host_tokens == len(prompt) + 6 - 1
    assert ie.prefix_of("s", "tiny-moe", other + [1, 2], "a").host_tokens == len(other)
    [rid] = [ie.add_request(follow, GREEDY, model="tiny-dense", cache_salt="a", session="s")]
    got = run(ie, [rid])[rid]
    mesh = make_mesh(jax.devices()[:1])
    assert got == greedy_generate(load_model("tiny-dense", mesh).model, [follow], 6)[0]


def test_a_diverging_prompt_restores_the_common_prefix_from_host_and_decodes_right(ie):
    """The next prompt extends only part of the session's host copy, and the device cache was dropped:
    the common prefix is restored from host (a partial last page included) and the tokens are those
    of a full recompute."""
    ie.reset(get_policy("talaria"))
    first = list(range(100, 121))  # 21 tokens: 2 full pages and a partial one
    run(ie, [ie.add_request(first, GREEDY, model="tiny-dense", cache_salt="a", session="s")])
    out = list(ie.instance.tokens.context("s", "tiny-dense")[len(first):])
    nxt = first + [(out[0] + 1) % 256, 9, 9, 9]
    for e in ie.engines:
        e.prefix_cache.clear()
    eng = ie.engine_of("tiny-dense")
    before = eng.stats.restored_tokens
    [got] = run(ie, [rid := ie.add_request(nxt, GREEDY, model="tiny-dense", cache_salt="a", session="s")]).values()
    assert eng.stats.restored_tokens - before == len(first)
    assert got == greedy_generate(load_model("tiny-dense", make_mesh(jax.devices()[:1])).model, [nxt], 6)[0], rid


def test_an_abort_frees_pages_and_idle_sessions_are_forgotten(ie):
    ie.reset(get_policy("talaria"))
    long = SamplingParams(max_tokens=100, temperature=0.0, ignore_eos=True)
    rid = ie.add_request(list(range(40)), long, model="tiny-moe", cache_salt="a", session="gone")
    for _ in range(3):
        ie.step()
    assert ie.abort(rid) is not None and not ie.has_unfinished()
    eng = ie.engine_of("tiny-moe")
    assert not eng.requests and eng.allocator.num_used == sum(e.prefix_cache.num_pages for e in ie.engines)
    ie.session_ttl_s = 3600.0
    run(ie, [ie.add_request([1, 2, 3], GREEDY, model="tiny-moe", cache_salt="a", session="idle")])
    run(ie, [ie.add_request([4, 5, 6], GREEDY, model="tiny-moe", cache_salt="a")])  # a single call: forgotten
    # the aborted session may return; the single call is gone; only "idle" has KV on host
    assert set(ie.sessions.sessions) == {"gone", "idle"} and ie.instance.kv.with_host_copy() == {"idle"}
    ie.session_ttl_s = 0.0  # now every idle session is past its time
    run(ie, [ie.add_request([7, 8, 9], GREEDY, model="tiny-moe", cache_salt="a")])
    assert len(ie.sessions) == 0 and not ie.instance.kv.with_host_copy() and not ie.instance.tokens.history
    ie.session_ttl_s = 3600.0


def test_a_call_that_says_it_ends_its_session_frees_the_session_once_hints_hold(ie):
    ie.reset(get_policy("talaria"))
    for k in range(4):  # each session says one call follows, then that it ends
        for left in (1, 0):
            run(ie, [ie.add_request([1 + k, 2, 3, 4 - left], GREEDY, model="tiny-moe", cache_salt="a",
                                    session=f"s{k}", hints=Hints(calls_left=left, tool_s=0.5))])
    # the first two ends were not believed (fewer than three sessions had borne a hint out by then):
    # those sessions keep their KV for a return, until their ttl; s2's second call was the third to
    # bear a hint out, so s2 and s3 are freed as their last calls end
    assert set(ie.sessions.sessions) == {"s0", "s1"} and ie.instance.kv.with_host_copy() == {"s0", "s1"}
    assert not {"s2", "s3"} & set(ie.scheduler.state[ie.instance.name].budget.reservations)
    ie.reset(get_policy("talaria"))
