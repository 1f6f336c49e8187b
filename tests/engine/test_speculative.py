"""Speculative decoding with suffix drafts: the drafter's trees, the lossless verifier (a statistical
test), the engine's output with drafts equal to its output without (greedy and seeded, chain and tree,
one device and a TP mesh), no page left behind by rejected drafts, and the load policy."""
import collections
import gc

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from talaria_jax.engine.engine import Engine, EngineConfig
from talaria_jax.engine.sampling import SamplingParams
from talaria_jax.models import init_model, load_model_config
from talaria_jax.engine.spec.policy import SpecPolicy
from talaria_jax.engine.spec.suffix import Draft, SpecConfig, SuffixDrafter, SuffixTree, TokenScan, best_draft
from talaria_jax.engine.spec.verify import verify
from talaria_jax.sharding import make_mesh

# ---- drafter ---------------------------------------------------------------------------------------


def _draft_key(d):
    return sorted(zip(d.tokens.tolist(), np.round(d.probs, 5).tolist())), round(d.score, 5), d.match_len


@pytest.mark.parametrize("tree", [False, True])
def test_scan_drafts_like_a_trie(tree):
    """A request's own text is scanned, not indexed: it must draft exactly what a suffix trie would."""
    rng = np.random.default_rng(0)
    cfg = SpecConfig(tree=tree, max_spec_factor=2.0, min_token_prob=0.05)
    for _ in range(150):
        text = rng.integers(0, 4, rng.integers(5, 60)).tolist()
        trie = SuffixTree(64)
        trie.extend("a", text)
        pattern = text[-int(rng.integers(1, 10)):]
        a, b = trie.draft(pattern, 8, cfg), TokenScan(text, 64).draft(pattern, 8, cfg)
        assert _draft_key(a) == _draft_key(b)
        assert a.tokens.tolist() == b.tokens.tolist() and a.parents.tolist() == b.parents.tolist()


class _SubstringOps:
    """The drafting functions' view of brute-force substring counts (a node is its substring): the
    reference a trie must draft exactly like."""

    def __init__(self, seqs, depth):
        self.depth = depth
        self.counts = collections.Counter(tuple(s[i:j]) for s in seqs for i in range(len(s))
                                          for j in range(i + 1, min(i + depth, len(s)) + 1))
        self.counts[()] = sum(len(s) for s in seqs)
        self.kids = collections.defaultdict(list)
        for w in self.counts:
            if w:
                self.kids[w[:-1]].append(w)

    def count(self, w):
        return self.counts[w]

    def children(self, w, min_count=0):
        return [(k[-1], self.counts[k], k) for k in self.kids[w] if self.counts[k] >= min_count]

    def going_on(self, w):
        return sum(self.counts[k] for k in self.kids[w])

    def best_child(self, w):
        kids = self.children(w)
        return max(kids, key=lambda k: (k[1], -k[0])) if kids else None

    def run(self, w, n, p, min_prob, above=-1.0):  # no steps at once: the drafts take them one by one
        return [], [], w

    def draft(self, pattern, max_tokens, cfg):
        pattern = tuple(pattern[-self.depth:])
        matches = [(k, self.counts[pattern[-k:]], pattern[-k:]) for k in range(len(pattern), 0, -1)
                   if pattern[-k:] in self.counts]
        return best_draft(matches, self, max_tokens, cfg, self.depth)


def _random_edit(t, seqs, rng, remove_p):
    """One random change to trie t and to seqs, its sequences in full: a sequence removed, or tokens
    appended to one (in-flight requests grow interleaved), new ones or, as a sibling repeats
    another's text, a stretch of another sequence."""
    sid = int(rng.integers(0, 6))
    if rng.random() < remove_p:
        t.remove(sid)
        seqs.pop(sid, None)
        return
    toks = rng.integers(0, 3, rng.integers(0, 12)).tolist()
    if seqs and rng.random() < 0.5:
        other = seqs[list(seqs)[int(rng.integers(0, len(seqs)))]]
        start = int(rng.integers(0, max(1, len(other))))
        toks = other[start:start + int(rng.integers(1, 40))]
    t.extend(sid, toks)
    seqs.setdefault(sid, []).extend(toks)


@pytest.mark.parametrize("tree", [False, True])
def test_trie_drafts_like_substring_counts(tree):
    """Against brute force: after any mix of extends and removals, the trie drafts exactly what the
    substring counts give, for any pattern and for a sequence's own tail (the drafter's case)."""
    rng = np.random.default_rng(1)
    for depth in (1, 3, 8, 64):
        cfg = SpecConfig(tree=tree, max_spec_factor=float(rng.choice([1.0, 4.0])), min_token_prob=0.07)
        t, seqs = SuffixTree(depth), {}
        for _ in range(250):
            _random_edit(t, seqs, rng, remove_p=0.1)
            ref = _SubstringOps(list(seqs.values()), depth)
            for _ in range(3):
                own = seqs and rng.random() < 0.6
                if own:
                    sid = list(seqs)[int(rng.integers(0, len(seqs)))]
                    pattern = rng.integers(0, 3, rng.integers(0, 4)).tolist() + seqs[sid][-depth:]
                else:
                    pattern = rng.integers(0, 3, rng.integers(1, 2 * depth)).tolist()
                limit = int(rng.integers(1, 12))
                got = t.draft(pattern, limit, cfg, sid if own else None)
                want = ref.draft(pattern, limit, cfg)
                assert _draft_key(got) == _draft_key(want), (depth, pattern)
                assert got.tokens.tolist() == want.tokens.tolist() and got.parents.tolist() == want.parents.tolist()


def test_trie_counts_matches_and_removal():
    t = SuffixTree(max_depth=4)
    t.extend("x", [1, 2, 3, 1, 2, 4])
    assert [t.depth(n) for n in t.match([9, 1, 2])] == [2, 1]
    d = t.draft([7, 1, 2], 4, SpecConfig(max_spec_factor=2.0, min_token_prob=0.0))
    assert d.tokens.tolist() == [3, 1] and d.match_len == 2  # [1 2] -> 3 (tie with 4: the smaller token)
    assert np.allclose(d.probs, [0.5, 0.5])
    nodes = t.num_nodes
    t.extend("y", [5, 1, 2, 4, 4])
    t.extend("x", [7])
    assert t.draft([1, 2], 4, SpecConfig(max_spec_factor=2.0, min_token_prob=0.0)).tokens[0] == 4  # now 2:1
    t.remove("y")
    t.remove("x")
    assert t.num_nodes == 1 and not t.ops.children(t.root) and t.num_tokens == 0 and not t.match([1, 2])
    assert nodes > 1


def test_trie_counts_every_substring_through_extends_and_removals():
    """Against brute force: after any mix of extends and removals, the trie holds exactly the
    substrings (up to max_depth) of the sequences it holds, each with its number of occurrences,
    and stores at most a node each."""
    rng = np.random.default_rng(0)
    for depth in (1, 3, 6):
        t, seqs = SuffixTree(depth), {}
        for _ in range(300):
            _random_edit(t, seqs, rng, remove_p=0.2)
            want = collections.Counter(tuple(s[i:j]) for s in seqs.values() for i in range(len(s))
                                       for j in range(i + 1, min(i + depth, len(s)) + 1))
            got, stack, stored = {}, [((), t.root)], 1
            while stack:
                path, node = stack.pop()
                for tok, count, child in t.ops.children(node):
                    got[path + (tok,)] = count
                    stack.append((path + (tok,), child))
                    stored += isinstance(child, int)  # a stored node (else a leaf's occurrence read on)
            assert got == want and t.num_nodes == stored <= len(want) + 1


def test_a_large_trie_holds_no_objects_for_the_garbage_collector():
    """Nodes are ints in flat lists, so a trie of ~100K nodes adds a handful of tracked objects
    (a node object each made the collector's passes cost as much as the insertions)."""
    text = np.random.default_rng(0).integers(0, 50_000, 1_600).tolist()
    gc.collect()
    before = len(gc.get_objects())
    t = SuffixTree(64)
    t.extend("a", text)
    t.extend("b", text)  # every substring of up to 64 tokens occurs twice: a node each
    assert t.num_nodes > 100_000 and len(gc.get_objects()) - before < 100


def test_text_seen_once_stores_about_a_node_per_token():
    """A path that one occurrence alone reaches is stored as its first node (a leaf pointing into the
    sequence), not max_depth nodes per token."""
    rng = np.random.default_rng(0)
    t = SuffixTree(64)
    t.extend("a", rng.integers(0, 50_000, 2_000).tolist())
    assert t.num_nodes < 2 * 2_000
    t.extend("b", rng.integers(0, 50_000, 2_000).tolist())
    assert t.num_nodes < 2 * 4_000


def test_a_shorter_match_drafts_past_the_depth_limit():
    """Near the trie's depth a longer match cannot draft its full limit; a shorter one as frequent can."""
    t = SuffixTree(max_depth=8)
    t.extend("a", [1, 2, 3, 4, 5, 6, 7, 8, 9])
    d = t.draft([1, 2, 3, 4, 5, 6], 8, SpecConfig(max_spec_factor=4.0, min_token_prob=0.0))
    assert d.tokens.tolist() == [7, 8, 9] and d.match_len <= 5  # the depth-6 match reaches only 7, 8


def test_chain_and_tree_drafts():
    t = SuffixTree(8)
    for i, tail in enumerate(([5, 6], [5, 6], [5, 7], [8, 9])):
        t.extend(i, [1, 2, 3, *tail])
    chain = t.draft([1, 2, 3], 8, SpecConfig(max_spec_factor=1.0, min_token_prob=0.1))
    assert chain.tokens.tolist() == [5, 6] and chain.parents.tolist() == [-1, 0]
    assert np.allclose(chain.probs, [0.75, 0.5]) and chain.score == pytest.approx(1.25)
    tree = t.draft([1, 2, 3], 8, SpecConfig(tree=True, max_spec_factor=2.0, min_token_prob=0.2))
    # depth-first, most likely child first: 5 (.75) -> 6 (.5), 7 (.25); then 8 (.25) -> 9 (.25)
    assert tree.tokens.tolist() == [5, 6, 7, 8, 9]
    assert tree.parents.tolist() == [-1, 0, 0, -1, 3]
    assert tree.score == pytest.approx(0.75 + 0.5 + 0.25 + 0.25 + 0.25)
    assert t.draft([1, 2, 3], 2, SpecConfig(tree=True, max_spec_factor=2.0)).tokens.tolist() == [5, 6]


def test_drafter_tenants_siblings_and_memory_bound():
    dr = SuffixDrafter(SpecConfig(max_cached_tokens=12, max_spec_factor=4.0))
    dr.start("a", [1, 2], tenant="t1")
    dr.extend("a", [3, 4, 5, 6, 7])
    dr.start("b", [1, 2], tenant="t1")  # a sibling, in flight: drafts from a's response
    dr.start("c", [1, 2], tenant="t2")  # another tenant sees nothing of t1's text
    dr.extend("b", [3])
    dr.extend("c", [3])
    db, dc = dr.draft(["b", "c"])
    assert db.tokens.tolist() == [4, 5, 6, 7] and len(dc) == 0  # [3] matched: 4 x 1 tokens
    dr.finish("a")
    assert dr.num_cached_tokens() == 7
    dr.start("d", [9], tenant="t1")
    dr.extend("d", list(range(20, 30)))  # 18 tokens cached > 12: the finished response goes, in-flight stay
    dr.finish("d")
    assert dr.num_cached_tokens() <= 12 and "a" not in dr.global_trees["t1"]
    assert "b" in dr.global_trees["t1"]  # in flight: never evicted


# ---- verifier --------------------------------------------------------------------------------------


def _verify_many(probs, tokens, parent, depth, n, temperature=1.0, seed=0):
    """Runs `verify` over n rows with the same draft tree and target distributions (probs [K1, V], one
    per node), each row with its own seed: returns emitted tokens [n, K1] and counts [n]."""
    k1, v = probs.shape
    logits = jnp.asarray(np.log(np.tile(probs, (n, 1))), jnp.float32)  # row r*k1 + j: node j of row r
    node_idx = jnp.arange(n * k1, dtype=jnp.int32).reshape(n, k1)
    step_tokens = jnp.asarray(np.tile(tokens, n), jnp.int32)
    rows = jnp.arange(n, dtype=jnp.uint32)
    seeds = jnp.stack([jnp.full(n, seed, jnp.uint32), rows], 1)
    row = jnp.repeat(jnp.arange(n, dtype=jnp.int32), k1)
    draw_step = jnp.tile(jnp.asarray(depth, jnp.int32), n)
    toks, _, _, _, path, count = jax.jit(verify)(
        logits, step_tokens, row, draw_step, node_idx, jnp.tile(jnp.asarray(parent, jnp.int32), (n, 1)),
        jnp.ones(n, bool), jnp.full(n, temperature, jnp.float32), jnp.zeros(n, jnp.int32), jnp.ones(n, jnp.float32),
        seeds)
    return np.asarray(toks), np.asarray(count), np.asarray(path)


def _tv(samples, p):
    q = np.bincount(samples, minlength=len(p)) / len(samples)
    return 0.5 * np.abs(q - p).sum()


@pytest.mark.parametrize("kind", ["chain", "tree"])
def test_stochastic_verification_is_lossless(kind):
    """For fixed target distributions and arbitrary drafts, each emitted token is distributed as the target
    at its context: the first as p_root, the second (after an accepted draft d) as p_d. 40,000 rows; the
    tolerance (total variation 0.015) is ~5 standard errors of the empirical distributions."""
    probs = np.array([[.10, .15, .35, .05, .20, .15],   # root: drafts 2 (chain, tree) and 5 (tree)
                      [.30, .10, .05, .25, .20, .10],
                      [.10, .40, .10, .10, .20, .10],
                      [.05, .05, .30, .30, .10, .20]])
    if kind == "chain":  # root -> 2 -> 4 -> 1
        tokens, parent, depth = [0, 2, 4, 1], [-1, 0, 1, 2], [0, 1, 2, 3]
    else:  # root -> {2 -> 1, 5}: two children at the root
        tokens, parent, depth = [0, 2, 5, 1], [-1, 0, 0, 1], [0, 1, 1, 2]
    n = 40000
    toks, count, path = _verify_many(probs, tokens, parent, depth, n)
    assert _tv(toks[:, 0], probs[0]) < 0.015
    children = {tokens[j]: j for j in range(1, 4) if parent[j] == 0}
    accept = np.isin(toks[:, 0], list(children))
    assert np.mean(accept) == pytest.approx(sum(probs[0][t] for t in children), abs=0.01)  # P(accept) = sum p(d)
    for tok, node in children.items():  # after accepting draft `tok`, the next token follows that node's target
        rows = (toks[:, 0] == tok)
        assert (path[rows, 1] == node).all() and (count[rows] >= 2).all()
        assert _tv(toks[rows, 1], probs[node]) < 0.03
    assert (count[~accept] == 1).all()
    full = count == 4 if kind == "chain" else np.zeros(n, bool)
    if kind == "chain":  # every draft accepted: a bonus token from the last node's target
        assert full.sum() > 500 and _tv(toks[full, 3], probs[3]) < 0.08


def test_greedy_verification_accepts_the_argmax_path():
    probs = np.array([[.1, .6, .3], [.7, .2, .1], [.2, .2, .6]])
    toks, count, _ = _verify_many(probs, [0, 1, 1], [-1, 0, 1], [0, 1, 2], 3, temperature=0.0)
    assert (count == 2).all() and (toks[:, :2] == [1, 0]).all()  # draft 1 accepted, 1 rejected (argmax 0)


# ---- engine ----------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def dense1():
    return init_model(load_model_config("tiny-dense"), make_mesh(jax.devices()[:1]), seed=1)


def _prompts():
    rng = np.random.RandomState(0)
    shared = rng.randint(0, 256, 20).tolist()
    return [shared + rng.randint(0, 256, n).tolist() for n in (3, 17, 5, 9)] + [shared] * 2


def _engine(model, spec=None, **kw):
    return Engine(model, EngineConfig(**{"warmup": False, "page_size": 4, "max_seqs": 6, "max_tokens_per_step": 32,
                                         "max_model_len": 128, "speculation": spec, **kw}))


def test_engine_output_is_the_same_with_drafts(dense1):
    """Greedy and seeded sampling give the same tokens and logprobs with speculation as without (the verifier
    draws each token with the key a plain step would use), and rejected drafts leave no page behind."""
    params = [SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True, logprobs=3)] * 4 + \
             [SamplingParams(max_tokens=24, temperature=1.0, seed=s, ignore_eos=True) for s in (7, 8)]
    ref = _engine(dense1).generate(_prompts(), params, progress=False)
    eng = _engine(dense1, SpecConfig(policy="always", max_spec_tokens=6, min_token_prob=0.0))
    out = eng.generate(_prompts(), params, progress=False)
    assert [o.token_ids for o in out] == [r.token_ids for r in ref]
    assert np.allclose(np.concatenate([o.logprobs for o in out]), np.concatenate([r.logprobs for r in ref]), atol=1e-5)
    for o, r in zip(out[:4], ref[:4]):  # the top logprobs too: of the target, at each emitted token
        assert [sorted(t) for t in o.top_logprobs] == [sorted(t) for t in r.top_logprobs]
        assert np.allclose([v for t in o.top_logprobs for v in t.values()],
                           [v for t in r.top_logprobs for v in t.values()], atol=1e-5)
    st = eng.stats
    assert st.spec_steps and 0 < st.accepted_tokens < st.draft_tokens  # drafts both accepted and rejected
    assert eng.allocator.num_free == eng.allocator.num_pages


def test_tree_drafts_with_a_decoy_branch(dense1):
    """Tree drafts whose first branch is wrong and whose second is the true continuation: the accepted path
    leaves the depth-first order (its KV is then recomputed, not kept out of place), and the output is
    still the plain engine's."""
    params = SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True)
    prompts = _prompts()[:4]
    truth = {tuple(p): r.token_ids for p, r in zip(prompts, _engine(dense1).generate(prompts, params, progress=False))}
    eng = _engine(dense1, SpecConfig(policy="always", tree=True, max_spec_tokens=6))

    def oracle(ids, caps):  # [decoy] and [t0 -> t1 -> t2] below the last token
        out = []
        for rid, cap in zip(ids, caps):
            req = eng.requests[rid]
            nxt = truth[req.prompt][len(req.output):][:3]
            toks = [(nxt[0] + 1) % 256, *nxt] if nxt else []
            d = Draft(np.asarray(toks, np.int32), np.asarray([-1, -1, 1, 2][:len(toks)], np.int32),
                      np.ones(len(toks), np.float32))
            out.append(d.first(cap))
        return out

    eng.drafter.draft = oracle
    out = eng.generate(prompts, params, progress=False)
    assert [o.token_ids for o in out] == [truth[tuple(p)] for p in prompts]
    assert eng.stats.accepted_tokens > eng.stats.spec_steps  # several tokens accepted per step, past the decoy
    assert eng.allocator.num_free == eng.allocator.num_pages


def test_rejected_drafts_give_their_pages_back(dense1):
    """After each speculative step a running sequence holds exactly the pages its computed tokens need."""
    eng = _engine(dense1, SpecConfig(policy="always", max_spec_tokens=6, min_token_prob=0.0))
    for p in _prompts():
        eng.add_request(p, SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True))
    while eng.has_unfinished():
        eng.step()
        for req in eng.running:
            assert len(req.seq.pages) == -(-req.num_computed // eng.page_size) or req.num_tokens - req.num_computed > 1
    assert eng.stats.accepted_tokens < eng.stats.draft_tokens
    assert eng.allocator.num_free == eng.allocator.num_pages


def test_greedy_with_drafts_on_tp_mesh():
    cfg = load_model_config("tiny-dense")
    one = init_model(cfg, make_mesh(jax.devices()[:1]), seed=2)
    two = init_model(cfg, make_mesh(jax.devices()[:2], tp=2), seed=2)
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    ref = _engine(one).generate(_prompts()[:3], params, progress=False)
    eng = _engine(two, SpecConfig(policy="always", tree=True, max_spec_tokens=4, min_token_prob=0.0), max_seqs=4,
                  max_tokens_per_step=16)
    out = eng.generate(_prompts()[:3], params, progress=False)
    assert [o.token_ids for o in out] == [r.token_ids for r in ref]
    assert eng.stats.accepted_tokens > 0


# ---- policy ----------------------------------------------------------------------------------------


def test_policy_speculates_while_steps_are_flat_and_stops_as_they_saturate():
    buckets = (1, 2, 4, 8, 16, 32, 64, 128)
    # weight-bound up to 16 tokens, compute-bound past it (time grows with tokens)
    cost = {t: max(1.0, t / 16) for t in buckets}
    pol = SpecPolicy(8, buckets, plain_s=cost, verify_s={t: 1.05 * c for t, c in cost.items()}, prior=(3.0, 1.0))
    ks = [pol.draft_len(b) for b in (1, 2, 4, 8, 16, 32)]
    assert ks[0] >= 3 and ks == sorted(ks, reverse=True) and ks[-1] == 0  # fewer drafts as the batch grows
    pol.observe(drafted=100, accepted=0)  # drafts that never pass: stop speculating at any batch
    pol.accepted, pol.rejected = 0.0, 50.0
    assert pol.draft_len(1) == 0
    assert SpecPolicy(8, buckets, None, None, always=True).draft_len(64) == 8
    pol = SpecPolicy(8, buckets, plain_s=cost, verify_s=cost, prior=(9.0, 1.0))
    assert pol.draft_len(2) > 0
    for t in (4, 8, 16, 32):  # real verifying steps turn out 10x the curve (attention over long contexts)
        for _ in range(20):
            pol.observe_step(True, t, 10 * cost[t])
    assert pol.draft_len(2) == 0
    pol = SpecPolicy(8, buckets, plain_s=cost, verify_s={t: 1.2 * c for t, c in cost.items()})
    assert pol.worth(2, 14, score=3.0)
    pol.observe(drafted=100, accepted=0, score=50.0)  # the drafter's scores turn out empty promises
    assert not pol.worth(2, 14, score=3.0) and pol.calibration < 0.05


def test_engine_measures_its_step_cost_curve(dense1):
    eng = _engine(dense1, SpecConfig(max_spec_tokens=6), max_seqs=2, max_tokens_per_step=4)
    pol = eng.spec_policy()
    assert set(pol.plain_s) == set(eng.runner.buckets) == set(pol.verify_s)
    assert all(v > 0 for v in pol.plain_s.values())
    with pytest.raises(ValueError, match="max_spec_tokens"):
        _engine(dense1, SpecConfig(max_spec_tokens=40))
