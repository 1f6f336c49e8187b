"""The rollout service (WAR part 2): placement, generate and multi-turn rollouts over two replicas
(two 4-device meshes), logprobs against the trainer's, update_weights, abort, the controls for RL
loops (pause modes, weight versions, partial rollouts, group aborts), HTTP, Ray actors."""
import contextlib
import socket
import threading
import time

import jax
import numpy as np
import pytest

from conftest import FAST_COMPILE, TEST_CACHE
from talaria_jax.engine import EngineConfig, RequestError, SamplingParams
from talaria_jax.models.model import forward, greedy_generate
from talaria_jax.rollout.placement import (CacheAware, LeastLoaded, PlacementRequest, PrefixIndex, ReplicaLoad, RoundRobin,
                                           make_placement)
from talaria_jax.rollout.replica import ReplicaSpec
from talaria_jax.rollout.server import RolloutClient, make_app
from talaria_jax.rollout.service import RolloutService
from talaria_jax.engine.spec.suffix import SpecConfig
from talaria_jax.serve.app import serving
from talaria_jax.weights import load_model

HALVES = ((0, 1, 2, 3), (4, 5, 6, 7))


def engine_config(spec=None, max_seqs=4):
    return EngineConfig(max_seqs=max_seqs, max_tokens_per_step=64, max_model_len=256, prefix_cache=True, warmup=False,
                        speculation=spec)


def replicas(spec=None, seed=0, max_seqs=4):
    return [ReplicaSpec("tiny-dense", devices=d, seed=seed, engine=engine_config(spec, max_seqs)).build()
            for d in HALVES]


@pytest.fixture(scope="module")
def trainer():
    """The trainer's copy of the weights, on one device (the replicas' are on two other meshes)."""
    return load_model("tiny-dense").model


def prompts(k=3, seed=0):
    rng = np.random.default_rng(seed)
    return [rng.integers(0, 256, 20 + 7 * i).tolist() for i in range(k)]


def trainer_logprobs(model, prompt, tokens):
    logits = np.asarray(forward(model, [list(prompt) + list(tokens)]))[0]
    lp = jax.nn.log_softmax(logits, axis=-1)
    return np.array([lp[len(prompt) - 1 + k, t] for k, t in enumerate(tokens)])


# ---- placement ------------------------------------------------------------------------------------

def test_prefix_index_counts_leading_blocks_and_evicts_lru():
    idx = PrefixIndex(block=4, capacity_blocks=3)
    idx.insert(list(range(10)))  # two whole blocks
    assert idx.match(list(range(12))) == 8 and idx.match([0, 1, 2, 3, 9, 9, 9, 9]) == 4 and idx.match([5] * 8) == 0
    idx.insert([7] * 8)  # two more blocks: the least recently used goes
    assert len(idx) == 3 and idx.match(list(range(8))) == 4 and idx.match([7] * 8) == 8


def test_cache_aware_keeps_trajectories_home_spreads_groups_and_admits_the_tail_first():
    p = CacheAware(2, block=4, capacity_blocks=100)
    a, b = list(range(40)), list(range(100, 140))
    loads = [ReplicaLoad(0, 4), ReplicaLoad(0, 4)]
    assert p.choose(PlacementRequest(tuple(a)), loads) == 0  # tie: the lower index
    p.computed(0, a)
    # the group's next sample and the trajectory's next turn go where its prefix is, while load allows
    assert p.choose(PlacementRequest(tuple(a)), [ReplicaLoad(2, 4), ReplicaLoad(0, 4)]) == 0
    assert p.choose(PlacementRequest(tuple(a + [1, 2, 3, 4])), [ReplicaLoad(3, 4), ReplicaLoad(0, 4)]) == 0
    assert p.choose(PlacementRequest(tuple(a)), [ReplicaLoad(9, 4), ReplicaLoad(0, 4)]) == 1  # too loaded
    assert p.choose(PlacementRequest(tuple(b)), [ReplicaLoad(1, 4), ReplicaLoad(0, 4)]) == 1  # a new prompt: load
    late, early = PlacementRequest((1,) * 50, "t", turn=3, arrival=9), PlacementRequest((1,) * 10, "u", turn=0, arrival=1)
    assert sorted([early, late], key=p.priority) == [late, early]
    p.reset()
    assert p.choose(PlacementRequest(tuple(a)), [ReplicaLoad(1, 4), ReplicaLoad(0, 4)]) == 1


def test_baselines():
    rr, ll = RoundRobin(), LeastLoaded()
    loads = [ReplicaLoad(5, 4), ReplicaLoad(1, 4), ReplicaLoad(3, 4)]
    assert [rr.choose(PlacementRequest((1,)), loads) for _ in range(4)] == [0, 1, 2, 0]
    assert ll.choose(PlacementRequest((1,)), loads) == 1
    gone = [ReplicaLoad(0, 4), None, ReplicaLoad(3, 4)]  # replica 1 failed
    assert [rr.choose(PlacementRequest((1,)), gone) for _ in range(3)] == [2, 0, 2] and ll.choose(None, gone) == 0
    ca = CacheAware(3, block=4, capacity_blocks=10)
    ca.computed(2, list(range(8)))
    assert ca.choose(PlacementRequest(tuple(range(8))), gone) == 2  # its cache, not the failed replica's
    assert rr.priority(PlacementRequest((1,), arrival=3)) < rr.priority(PlacementRequest((1,) * 9, turn=5, arrival=4))
    sticky = make_placement("sticky_least_loaded", 3)  # a trajectory stays where it started while that lives
    assert sticky.choose(PlacementRequest((1,), trajectory="a"), loads) == 1
    assert sticky.choose(PlacementRequest((1, 2), trajectory="a", turn=1), [ReplicaLoad(0, 4)] + loads[1:]) == 1
    assert sticky.choose(PlacementRequest((1, 2, 3), trajectory="a", turn=2), gone) == 0  # its replica failed
    assert sticky.choose(PlacementRequest((1,), trajectory="b"), loads) == 1


# ---- the service ----------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def service():
    with RolloutService(replicas()) as s:
        yield s


def test_generate_over_two_replicas_matches_the_reference(service, trainer):
    ps = prompts()
    out = service.generate(ps, SamplingParams(max_tokens=8, temperature=0), n=2)
    ref = greedy_generate(trainer, ps, 8)
    assert [[c.token_ids for c in g] for g in out] == [[r, r] for r in ref]
    assert {c.replica for g in out for c in g} == {0, 1}  # both replicas ran some
    assert all(c.finish_reason == "length" for g in out for c in g)


@pytest.mark.parametrize("speculate", [False, True])
def test_logprobs_match_the_trainer(request, trainer, speculate):
    spec = SpecConfig(max_spec_tokens=4, policy="always")  # without: the module's service (built once)
    with RolloutService(replicas(spec)) if speculate else contextlib.nullcontext(request.getfixturevalue("service")) as s:
        ps = prompts() + [[5, 6, 7, 8] * 6]
        sampled = s.generate(ps, SamplingParams(max_tokens=24, temperature=1.0, seed=3), n=2)
        greedy = s.generate(ps, SamplingParams(max_tokens=24, temperature=0))
        accepted = sum(r["accepted_tokens"] for r in s.stats()["replicas"])
    for p, group in zip(ps + ps, sampled + greedy):
        for c in group:
            np.testing.assert_allclose(c.logprobs, trainer_logprobs(trainer, p, c.token_ids), atol=1e-4)
    assert (accepted > 0) == speculate
    assert sampled[0][0].token_ids != sampled[0][1].token_ids  # the samples of a prompt differ


def test_multi_turn_rollout_is_placement_independent_and_reuses_the_trajectory_kv():
    def make_env(i, j):
        def env(c):
            return [300 + i, 301 + j, 302]
        return env

    # An odd number of trajectories over two replicas: round-robin alternates replicas call by call,
    # so it cannot keep every trajectory home whatever order the turns finish in (with an even
    # number it can, when the turns happen to finish in submission order).
    params = SamplingParams(max_tokens=6, temperature=1.0)
    runs = {}
    for placement in ("cache_aware", "round_robin"):
        with RolloutService(replicas(), placement, seed=7) as s:
            runs[placement] = (s.rollout(prompts(3), make_env, params, n=1, max_turns=3), s.stats())
    (war, war_stats), (rr, rr_stats) = runs["cache_aware"], runs["round_robin"]
    for g_war, g_rr, p in zip(war, rr, prompts(3)):
        for t, u in zip(g_war, g_rr):
            assert t.token_ids == u.token_ids and t.end == "max_turns" and len(t.turns) == 3
            assert t.prompt == p and len(t.mask) == len(t.logprobs) == len(t.token_ids)
            assert sum(t.mask) == 18 and t.mask[6:9] == [0, 0, 0]
            assert len({c.replica for c in t.turns}) == 1  # cache-aware: the trajectory stays home
            assert all(c.cached_tokens > 0 for c in t.turns[1:])
    assert war_stats["cached_tokens"] > rr_stats["cached_tokens"]


def test_rollout_ends_when_the_env_says_so_or_the_context_is_full(service):
    trajs = service.rollout([[1, 2, 3]], lambda i, j: (lambda c: None), SamplingParams(max_tokens=4), n=1)
    assert trajs[0][0].end == "done" and len(trajs[0][0].turns) == 1
    long = service.rollout([[1, 2, 3]], lambda i, j: (lambda c: [9] * 100), SamplingParams(max_tokens=40), max_turns=9)
    assert long[0][0].end == "context" and len(long[0][0].context()) + 40 > 256

    def make_env(i, j):  # the second trajectory's environment breaks while the first still runs
        def env(c):
            if j == 1:
                raise KeyError("tool crashed")
            time.sleep(0.5)
            return [7]
        return env
    with pytest.raises(KeyError, match="tool crashed"):
        service.rollout([[1, 2, 3]], make_env, SamplingParams(max_tokens=2), n=2, max_turns=50)
    assert service.stats()["in_flight"] == 0  # the rest was aborted, nothing left running


def test_update_weights_takes_effect_and_reuses_nothing_stale(trainer):
    new = load_model("tiny-dense", seed=1).model  # "the trainer's next weights": other values, same shapes
    spec = SpecConfig(max_spec_tokens=4, policy="always")
    p = [[5, 6, 7, 8] * 6]
    greedy = SamplingParams(max_tokens=12, temperature=0)
    with RolloutService(replicas(spec)) as s:
        before = s.generate(p, greedy)[0][0]
        assert before.token_ids == greedy_generate(trainer, p, 12)[0]
        with pytest.raises(ValueError, match="missing"):
            s.update_weights({"embed": np.zeros(3)})  # refused, nothing changed
        assert s.generate(p, greedy)[0][0].token_ids == before.token_ids
        s.update_weights(new.state)
        assert all(not w.replica.engine.drafter.global_trees for w in s.workers)  # drafts of the old policy gone
        after = s.generate(p, greedy, n=2)[0]
    assert after[0].token_ids == greedy_generate(new, p, 12)[0] != before.token_ids
    assert all(c.cached_tokens == 0 for c in after)  # the old weights' prefix KV is not reused


def test_engine_update_weights_refuses_requests_in_flight_and_old_host_kv(trainer):
    from talaria_jax.engine import Engine

    engine = Engine(load_model("tiny-dense").model, EngineConfig(max_seqs=2, max_model_len=128, warmup=False))
    rid = engine.add_request([1, 2, 3], SamplingParams(max_tokens=4), keep_kv=True)
    with pytest.raises(RequestError, match="1 requests are in flight"):
        engine.update_weights(trainer.state)
    done = {}
    while engine.has_unfinished():
        done.update({o.request_id: o for o in engine.step() if o.finished})
    engine.update_weights(load_model("tiny-dense", seed=2).model.state)
    with pytest.raises(RequestError, match="another model"):  # KV computed by the old weights
        engine.add_request([1, 2, 3] + done[rid].token_ids + [4], SamplingParams(max_tokens=2), restore=done[rid].kv)


def test_abort_returns_the_partial_tokens(service, trainer):
    result = {}
    params = SamplingParams(max_tokens=200, temperature=0, ignore_eos=True)
    thread = threading.Thread(target=lambda: result.update(out=service.generate([[3, 1, 4]], params,
                                                                               request_ids=["long"])))
    thread.start()
    deadline = time.time() + 60
    while not any("long" in w.running for w in service.workers):
        assert time.time() < deadline
        time.sleep(0.01)
    time.sleep(0.3)
    partial = service.abort("long")
    thread.join(timeout=60)
    assert partial.finish_reason == "abort" and 0 < len(partial.token_ids) < 200
    assert result["out"][0][0].token_ids == partial.token_ids
    assert partial.token_ids == greedy_generate(trainer, [[3, 1, 4]], len(partial.token_ids))[0]
    assert service.abort("long") is None and service.abort("nobody") is None


# ---- controls for RL loops: pause, weight versions, partial rollouts, groups -------------------------

LONG = SamplingParams(max_tokens=64, temperature=0, ignore_eos=True)


def decoded(s) -> int:
    """Tokens the replicas' engines have decoded so far (in process or Ray actors)."""
    return sum(r.get("decode_tokens", 0) for r in s.stats()["replicas"])


def wait_decoding(s, since: int, tokens: int = 12, timeout_s: float = 60.0):
    """Until the replicas have decoded `tokens` more than `since`: the requests are mid-generation
    (LONG's 64 tokens each are far off), however loaded the machine."""
    deadline = time.time() + timeout_s
    while decoded(s) - since < tokens:
        assert time.time() < deadline
        time.sleep(0.01)


def keep_swap(s, update, api=None):
    """Six long greedy requests in flight on `s` (through `api`: s itself or its HTTP client), paused
    with "keep", `update()` (new weights), resumed; their prompts and Completions."""
    api = api or s
    ps, out, since = prompts(6), {}, decoded(s)
    thread = threading.Thread(target=lambda: out.update(r=api.generate(ps, LONG)))
    thread.start()
    wait_decoding(s, since)
    api.pause("keep")
    assert s.paused == "keep" and not any(w.running for w in s.workers)  # every request off its replica
    update()
    api.resume()
    thread.join(timeout=120)
    return ps, [g[0] for g in out["r"]]


def check_swap(s, ps, outs, old_tokens):
    """Each output is its old-weights greedy prefix (version 0 tokens), then what a fresh run of the
    new weights (`s` serves them now) generates from prompt + that prefix (version 1 tokens, logprobs
    too): nothing of the old weights' KV was reused after the swap."""
    cut = [c.weight_versions.count(0) for c in outs]
    assert any(0 < k < LONG.max_tokens for k in cut), cut  # the swap happened mid-generation
    fresh = s.generate([list(p) + c.token_ids[:k] for p, c, k in zip(ps, outs, cut)],
                       SamplingParams(max_tokens=LONG.max_tokens, temperature=0, ignore_eos=True))
    for c, k, want, old in zip(outs, cut, fresh, old_tokens):
        assert c.weight_versions == [0] * k + [1] * (LONG.max_tokens - k)
        assert c.token_ids[:k] == old[:k]
        assert c.token_ids[k:] == want[0].token_ids[:LONG.max_tokens - k]
        np.testing.assert_allclose(c.logprobs[k:], want[0].logprobs[:LONG.max_tokens - k], atol=1e-4)


def test_pause_keep_swaps_weights_under_requests_in_flight(trainer):
    new = load_model("tiny-dense", seed=1).model
    with RolloutService(replicas()) as s:
        old = [g[0].token_ids for g in s.generate(prompts(6), LONG)]
        with pytest.raises(RequestError, match="pause, finish or abort"):  # unpaused, with requests in flight
            futures = s.submit(prompts(2), LONG)
            s.update_weights(new.state)
        [f[0].result(timeout=60) for f in futures]
        ps, outs = keep_swap(s, lambda: s.update_weights(new.state))
        assert s.weight_version == 1 and s.paused is None
        check_swap(s, ps, outs, old)
        with pytest.raises(RequestError, match="pause mode must be one of"):
            s.pause("hold")


def test_pause_abort_ends_requests_with_their_tokens_and_queues_new_ones(service):
    ps = prompts(10)  # more than the 8 slots: some wait in queues
    ref = [g[0].token_ids for g in service.generate(ps, LONG)]
    since = decoded(service)
    futures = service.submit(ps, LONG)
    wait_decoding(service, since)
    service.pause("abort")
    try:
        outs = [f[0].result(timeout=5) for f in futures]
        late = service.submit(ps[:1], LONG)
        time.sleep(0.5)
        assert not late[0][0].done()  # paused: it waits
    finally:
        service.resume()
    assert all(c.finish_reason == "abort" for c in outs)
    assert any(0 < len(c.token_ids) < LONG.max_tokens for c in outs)
    assert all(c.token_ids == r[:len(c.token_ids)] and c.weight_versions == [0] * len(c.token_ids)
               for c, r in zip(outs, ref))
    assert late[0][0].result(timeout=60).token_ids == ref[0]


def test_pause_finish_drains_the_running_and_holds_the_queued(service):
    ps = prompts(10)
    ref = [g[0].token_ids for g in service.generate(ps, LONG)]
    since = decoded(service)
    futures = [g[0] for g in service.submit(ps, LONG)]
    wait_decoding(service, since)
    service.pause("finish")
    try:
        done = [f.done() for f in futures]
        assert 2 <= done.count(False) == sum(len(w.queue) for w in service.workers)  # the queued wait
        assert all(f.result().finish_reason == "length" for f, d in zip(futures, done) if d)
    finally:
        service.resume()
    assert [f.result(timeout=60).token_ids for f in futures] == ref


def test_generate_until_returns_the_target_and_the_rest_resume_with_nothing_lost(service):
    ps = prompts(10)  # 8 wanted, 25% over-provisioned
    full = [g[0].token_ids for g in service.generate(ps, SamplingParams(max_tokens=32, temperature=0))]
    # six requests end within 8 tokens (a stop token the other four never emit), four run 32
    stops = {next(t for t in full[i][2:8] if all(t not in full[j] for j in range(6, 10))) for i in range(6)}
    params = SamplingParams(max_tokens=32, temperature=0, stop_token_ids=tuple(stops))
    ids = [f"p{i}" for i in range(10)]
    ref = {rid: g[0].token_ids for rid, g in zip(ids, service.generate(ps, params))}
    done, rest = service.generate_until(ps, params, target=8, request_ids=ids)
    assert len(done) == 8 and len(rest) == 2
    assert sum(len(p.token_ids) for p in rest) > 0  # cut in flight, their tokens kept
    with pytest.raises(RequestError, match=r"target must be an integer in \[1, 2\]"):
        service.generate_until([], params, target=3, resume=rest)
    done2, rest2 = service.generate_until([], params, target=2, resume=rest)
    assert rest2 == []
    got = {c.request_id: c for c in done + done2}
    assert sorted(got) == sorted(ids)
    for rid, c in got.items():
        assert c.token_ids == ref[rid] and c.weight_versions == [0] * len(c.token_ids)


def test_abort_group_stops_one_prompts_samples(service):
    since = decoded(service)
    futures = service.submit(prompts(2), LONG, n=3, request_ids=["a", "b"])
    wait_decoding(service, since)
    stopped = service.abort_group("a")
    assert sorted(c.request_id for c in stopped) == ["a-0", "a-1", "a-2"]
    assert all(c.finish_reason == "abort" for c in stopped)
    assert all(f.result(timeout=60).finish_reason == "length" for f in futures[1])  # b's samples ran on


def test_bad_input_is_refused_before_anything_runs(service):
    ok = SamplingParams(max_tokens=4)
    for bad, match in [("hello", "prompts must be"), ([[]], r"prompts\[0\] is empty"), ([[1, 512]], r"prompts\[0\]\[1\]"),
                       ([[1.5]], "not an integer"), ([[1] * 253], "context limit")]:
        with pytest.raises(RequestError, match=match):
            service.generate(bad, ok)
    with pytest.raises(RequestError, match="n must be"):
        service.generate([[1]], ok, n=0)
    with pytest.raises(RequestError, match="temperature"):
        service.generate([[1]], SamplingParams(temperature=-1.0))
    with pytest.raises(RequestError, match="trajectory_ids has 1 entries for 2 prompts"):
        service.generate([[1], [2]], ok, trajectory_ids=["a"])
    assert service.stats()["in_flight"] == 0 and service.generate([[1, 2]], ok)[0][0].finish_reason == "length"


class _Failing:
    """A replica that dies at its second step (an engine gone, a Ray actor lost)."""

    def __init__(self, replica):
        self.replica, self.steps = replica, 0

    def __getattr__(self, name):
        return getattr(self.replica, name)

    def step(self, max_steps=1, speculate=True):
        self.steps += 1
        if self.steps > 1:
            raise RuntimeError("device lost")
        return self.replica.step(max_steps, speculate)


def test_a_failed_replica_loses_no_request(trainer):
    first, second = replicas()
    ps = prompts(4)
    with RolloutService([_Failing(first), second], "round_robin") as s:
        out = s.generate(ps, SamplingParams(max_tokens=6, temperature=0))
        stats = s.stats()
    assert [g[0].token_ids for g in out] == greedy_generate(trainer, ps, 6)
    assert {g[0].replica for g in out} == {1} and stats["replaced"] == 2 and "device lost" in stats["replicas"][0]["dead"]


class _Recording:
    """A replica that records the speculate flag of each of its steps."""

    def __init__(self, replica):
        self.replica, self.flags = replica, []

    def __getattr__(self, name):
        return getattr(self.replica, name)

    def step(self, max_steps=1, speculate=True):
        self.flags.append(speculate)
        return self.replica.step(max_steps, speculate)


def test_speculation_is_off_while_requests_wait_for_a_slot(trainer):
    spec = SpecConfig(max_spec_tokens=4, policy="always")
    reps = [_Recording(r) for r in replicas(spec, max_seqs=1)]
    p = [[5, 6, 7, 8] * 6]
    with RolloutService(reps) as s:
        out = s.generate(p, SamplingParams(max_tokens=16, temperature=0), n=4)  # 4 requests, 2 slots
        stats = s.stats()
    assert [c.token_ids for c in out[0]] == greedy_generate(trainer, p, 16) * 4
    for r in reps:  # saturated at first (two wait): plain steps; at the end nothing waits: drafts pay
        assert r.flags[0] is False and r.flags[-1] is True
    assert sum(r["accepted_tokens"] for r in stats["replicas"]) > 0


def test_an_idle_replica_takes_waiting_requests_from_a_full_one():
    from talaria_jax.rollout.placement import CacheAware

    p = [[9, 8, 7, 6] * 8]
    greedy = SamplingParams(max_tokens=4, temperature=0)
    with RolloutService(replicas(max_seqs=2), CacheAware(2, 16, 1000, locality=10.0)) as s:
        s.generate(p, greedy)  # replica 0 now holds the prompt: locality 10 piles every sample there
        out = s.generate(p, SamplingParams(max_tokens=24, temperature=0), n=6)
        stats = s.stats()
    assert stats["stolen"] > 0 and {c.replica for c in out[0]} == {0, 1}


# ---- HTTP -----------------------------------------------------------------------------------------

def test_http_api_matches_the_in_process_service(tmp_path, trainer):
    from talaria_jax.weights import checkpoint

    with RolloutService(replicas()) as s, serving(make_app(s, api_keys=["sk-r"])) as url:
        client = RolloutClient(url, api_key="sk-r")
        ps, params = prompts(2), SamplingParams(max_tokens=5, temperature=0)
        assert [[c.token_ids for c in g] for g in client.generate(ps, params, n=2, trajectory_ids=["a", "b"])] == \
            [[c.token_ids for c in g] for g in s.generate(ps, params, n=2)]
        r = client.http.post("/v1/generate", json={"prompts": [[1]], "sampling": {"max_tokns": 3}})
        assert r.status_code == 400 and "unknown fields" in r.json()["error"]["message"]
        with pytest.raises(RequestError, match=r"prompts\[0\]\[0\] is 999"):
            client.generate([[999]], params)
        assert client.abort("nobody") is None
        # the instance server's key check and error body (talaria_jax.web)
        wrong = RolloutClient(url, api_key="wrong").http.get("/v1/stats")
        assert wrong.status_code == 401 and wrong.json()["error"]["code"] == "invalid_api_key"
        for path, content, status, says in [("/v1/generate", b"{not json", 400, "not valid JSON"),
                                            ("/v1/generate", b"[1, 2]", 400, "must be a JSON object"),
                                            ("/v1/generate", b'{"prompts": [[1]], "n": "2"}', 400, "n must be"),
                                            ("/v1/nothing", b"{}", 404, "Not Found")]:
            r = client.http.post(path, content=content)
            assert r.status_code == status and says in r.json()["error"]["message"], (path, r.text)
        new = load_model("tiny-dense", seed=1)
        checkpoint.save(new.model, tmp_path / "ckpt")
        old = [g[0].token_ids for g in client.generate(prompts(6), LONG)]
        check_swap(s, *keep_swap(s, lambda: client.update_weights(str(tmp_path / "ckpt")), api=client), old)
        assert client.generate(ps[:1], params)[0][0].token_ids == greedy_generate(new.model, ps[:1], 5)[0]
        done, rest = client.generate_until(ps, params, n=2, target=3)
        assert len(done) == 3 and len(rest) == 1 and rest[0].prompt in ps  # whichever finished last
        left = rest[0].prompt
        done, rest = client.generate_until([], params, target=1, resume=rest)
        assert rest == [] and done[0].token_ids == greedy_generate(new.model, [left], 5)[0]
        assert client.abort_group("nobody") == []
        with pytest.raises(RequestError, match="checkpoint"):
            client.update_weights(str(tmp_path / "missing"))
        assert client.stats()["completed"] >= 5


# ---- Ray ------------------------------------------------------------------------------------------

def test_ray_actor_replicas_return_the_in_process_tokens(service):
    ray = pytest.importorskip("ray", reason="ray is not installed (pip install 'talaria_jax[ray]')")
    from talaria_jax.rollout.ray_replicas import ray_replicas

    ps, params = prompts(3), SamplingParams(max_tokens=8, temperature=0)
    local = service.generate(ps, params, n=2)
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    try:
        spec = ReplicaSpec("tiny-dense", engine=engine_config(), compilation_cache=TEST_CACHE)  # the tests' cache
        env = {"JAX_PLATFORMS": "cpu", "XLA_FLAGS": f"--xla_force_host_platform_device_count=4 {FAST_COMPILE}"}
        with RolloutService(ray_replicas(spec, 2, num_cpus=1, env_vars=env)) as s:
            remote = s.generate(ps, params, n=2)
            old = [g[0].token_ids for g in s.generate(prompts(6), LONG)]
            new = load_model("tiny-dense", seed=1).model.state  # through the object store
            check_swap(s, *keep_swap(s, lambda: s.update_weights(new)), old)
            changed = s.generate(ps[:1], params)
    finally:
        ray.shutdown()
    assert [[c.token_ids for c in g] for g in remote] == [[c.token_ids for c in g] for g in local]
    assert {c.replica for g in remote for c in g} == {0, 1}
    assert changed[0][0].token_ids == greedy_generate(load_model("tiny-dense", seed=1).model, ps[:1], 8)[0]


def test_talaria_rollout_launcher_serves_and_exits_on_sigterm():
    import signal
    import subprocess
    import sys

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    cmd = [sys.executable, "-m", "talaria_jax.launch.rollout", "--model=tiny-dense", "--nowarmup", "--speculate=0",
           "--max_model_len=128", "--compilation_cache=off"]
    bad = subprocess.run(cmd + ["--replicas=5", "--devices_per_replica=2"], capture_output=True, text=True, timeout=120)
    assert bad.returncode != 0 and "exceeds the 8 devices" in bad.stderr
    proc = subprocess.Popen(cmd + [f"--port={port}"], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        client, deadline = RolloutClient(f"http://127.0.0.1:{port}"), time.time() + 120
        while True:
            with contextlib.suppress(Exception):
                if client.http.get("/health").status_code == 200:
                    break
            assert proc.poll() is None and time.time() < deadline, "the server did not come up"
            time.sleep(0.2)
        out = client.generate([[1, 2, 3] * 7], SamplingParams(max_tokens=4, temperature=0), n=2)
        assert [c.token_ids for c in out[0]] == [greedy_generate(load_model("tiny-dense").model, [[1, 2, 3] * 7], 4)[0]] * 2
        proc.send_signal(signal.SIGTERM)  # uvicorn shuts down, then re-raises the signal: exit status -15
        assert proc.wait(timeout=60) in (0, -signal.SIGTERM) and "Traceback" not in proc.stdout.read()
    finally:
        proc.kill()
