"""Automatic prefix caching: the PrefixCache radix tree on its own (match, insert, eviction order,
refcounts, keys), and in the engine against the full-sequence reference (multi-turn sessions,
siblings sharing a system prompt, tenant salts, memory pressure)."""
import tracemalloc

import jax
import numpy as np
import pytest

from talaria_jax.engine.engine import Engine, EngineConfig, RequestError, StepError
from talaria_jax.engine.sampling import SamplingParams
from talaria_jax.kvcache.allocator import PageAllocator
from talaria_jax.kvcache.prefix import PrefixCache
from talaria_jax.models import greedy_generate, init_model, load_model_config
from talaria_jax.sharding import make_mesh

GREEDY = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
PS = 4  # page size of every engine here


def config(**kw) -> EngineConfig:
    return EngineConfig(**{"warmup": False, "page_size": PS, "max_seqs": 4, "max_tokens_per_step": 32,
                           "max_model_len": 96, **kw})


def rand(seed, n):
    return np.random.RandomState(seed).randint(0, 256, n).tolist()


@pytest.fixture(scope="module")
def dense1():
    return init_model(load_model_config("tiny-dense"), make_mesh(jax.devices()[:1]), seed=1)


def reference(model, prompts, max_tokens=GREEDY.max_tokens):
    return greedy_generate(model, prompts, max_tokens)


# ---- PrefixCache on its own ------------------------------------------------------------------------
def _seq(alloc, n_pages):
    return alloc.allocate(n_pages)


def test_match_insert_refcounts():
    alloc = PageAllocator(16)
    cache = PrefixCache(alloc, page_size=2)
    toks = [1, 2, 3, 4, 5, 6, 7]  # 3 full pages + 1 partial token
    pages = _seq(alloc, 4)
    assert cache.insert("k", toks, pages) == 3  # the partial page stays out
    assert [alloc.refcount(p) for p in pages] == [2, 2, 2, 1]
    alloc.free(pages)  # the sequence finishes
    assert cache.num_pages == 3 and alloc.num_free == 13

    hit = cache.match("k", [1, 2, 3, 4, 9, 9], max_tokens=5)
    assert hit == pages[:2]
    assert [alloc.refcount(p) for p in hit] == [2, 2]
    assert cache.match("k", [1, 2, 3, 4, 5, 6], max_tokens=5) == pages[:2]  # max_tokens caps at full pages
    assert cache.match("k", [1, 2, 3, 4, 5, 6]) == pages[:3]
    assert cache.match("k", [2, 1]) == [] and cache.match("other", [1, 2]) == []
    assert cache.stats.hit_tokens == 4 + 4 + 6 and cache.stats.queried_tokens == 5 + 5 + 6 + 2 + 2

    # the same tokens again from another sequence's own pages: nothing duplicated, its copy is its own
    other = _seq(alloc, 3)
    assert cache.insert("k", [1, 2, 3, 4, 5, 6], other) == 0
    assert [alloc.refcount(p) for p in other] == [1, 1, 1]
    alloc.free(other)
    # a longer run extends the path
    ext = _seq(alloc, 1)
    assert cache.insert("k", [1, 2, 3, 4, 5, 6, 7, 8], pages[:3] + ext) == 1
    alloc.free(ext)
    for h in ([pages[0], pages[1]], [pages[0], pages[1]], pages[:3]):
        alloc.free(h)  # the matches above
    assert cache.num_pages == 4 and alloc.num_free == 12
    assert cache.evict(100) == 4
    assert alloc.num_free == 16 and all(alloc.refcount(p) == 0 for p in range(16)) and cache.num_pages == 0


def test_evict_order_lru_leaves_first_protected_last_held_never():
    t = [0.0]
    alloc = PageAllocator(32)
    cache = PrefixCache(alloc, page_size=1, clock=lambda: t[0])
    # three branches under key "a": [1,2,3], [1,4], [5,6]; and key "p" (protected): [7,8]
    seqs = {}
    for key, toks in [("p", [7, 8]), ("a", [1, 2, 3]), ("a", [1, 4]), ("a", [5, 6])]:
        pages = _seq(alloc, len(toks))
        cache.insert(key, toks, pages)
        alloc.free(pages)
        seqs[(key, tuple(toks))] = pages
    cache.protect("p", until=10.0)
    # touch [5,6] and [1,2,3] so [1,4] is the least recently used unprotected leaf ([7,8] is older still)
    for toks in ([5, 6], [1, 2, 3]):
        alloc.free(cache.match("a", toks))
    held = cache.match("a", [1, 2, 3])  # a running sequence holds [1,2,3]: none of its pages may go

    assert cache.evict(1) == 1
    assert alloc.refcount(seqs[("a", (1, 4))][1]) == 0  # page of token 4: LRU unprotected leaf
    before = alloc.num_free
    assert cache.evict(2) == 2  # then [5,6]: leaf 6 first, then its parent 5
    assert alloc.refcount(seqs[("a", (5, 6))][0]) == 0 and alloc.refcount(seqs[("a", (5, 6))][1]) == 0
    assert alloc.num_free == before + 2
    # only held pages and protected ones are left: protected go before held, leaves first
    assert cache.evict(1) == 1 and alloc.refcount(seqs[("p", (7, 8))][1]) == 0
    assert cache.evict(10) == 1 and alloc.refcount(seqs[("p", (7, 8))][0]) == 0
    assert all(alloc.refcount(p) == 2 for p in held)  # never freed while held
    assert cache.evict(10) == 0
    alloc.free(held)
    assert cache.evict(10) == 3
    assert alloc.num_free == 32 and cache.num_pages == 0


def _old_and_new(clock):
    """A cache over 8 one-token pages holding "old" (least recently used) and "new", "old" protected until 5."""
    alloc = PageAllocator(8)
    cache = PrefixCache(alloc, page_size=1, clock=clock)
    for key, toks in [("old", [1]), ("new", [2])]:
        pages = _seq(alloc, 1)
        cache.insert(key, toks, pages)
        alloc.free(pages)
    cache.protect("old", until=5.0)
    return alloc, cache


def test_protection_expires_and_protected_goes_last():
    t = [0.0]
    alloc, cache = _old_and_new(lambda: t[0])
    assert cache.evict(1) == 1  # "old" is least recently used but protected: "new" goes first
    hit = cache.match("old", [1])
    assert hit != [] and cache.match("new", [2]) == []
    cache.clear()  # drops the cache's references; the match is still ours
    assert alloc.num_free == 7 and alloc.refcount(hit[0]) == 1
    alloc.free(hit)
    assert alloc.num_free == 8
    # expiry: once past `until`, protected entries are plain LRU again
    _, c2 = _old_and_new(lambda: t[0])
    t[0] = 6.0
    assert c2.evict(1) == 1 and c2.match("old", [1]) == [] and c2.match("new", [2]) != []



def test_protect_makes_no_empty_roots():
    # a key the cache kept with no pages and no protection would hold a hundred bytes or more for
    # good: the 10k keys here would leave most of a megabyte behind
    cache = PrefixCache(PageAllocator(4), page_size=1)
    gone, lifted = [f"gone-{i}" for i in range(5000)], [f"s-{i}" for i in range(5000)]
    tracemalloc.start()
    try:
        for key in gone:
            cache.protect(key, None)  # lifting a protection that was never set
        for key in lifted:
            cache.protect(key, 10.0)
            cache.protect(key, None)  # lifted with no pages under it
        held, _ = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert held < 20_000


def test_keys_isolate_tenants_and_weights(dense1):
    other = init_model(load_model_config("tiny-dense"), make_mesh(jax.devices()[:1]), seed=2)
    assert other.fingerprint != dense1.fingerprint
    alloc = PageAllocator(8)
    cache = PrefixCache(alloc, page_size=2)
    key = ("tiny-dense", dense1.fingerprint, None)
    pages = _seq(alloc, 2)
    cache.insert(key, [1, 2, 3, 4], pages)
    alloc.free(pages)
    assert cache.match(("tiny-dense", other.fingerprint, None), [1, 2, 3, 4, 5]) == []
    assert cache.match(("tiny-dense", dense1.fingerprint, "tenant"), [1, 2, 3, 4, 5]) == []
    hit = cache.match(key, [1, 2, 3, 4, 5])
    assert hit == pages
    # the engine's key carries the weights fingerprint and the salt
    e1, e2 = Engine(dense1, config(prefix_cache=True)), Engine(other, config(prefix_cache=True))
    assert e1.prefix_key("s") != e2.prefix_key("s")
    assert e1.prefix_key("s")[1] == dense1.fingerprint and e1.prefix_key("s")[2] == "s"


# ---- in the engine ---------------------------------------------------------------------------------
def _run(eng, prompt, params=GREEDY, **kw):
    rid = eng.add_request(prompt, params, **kw)
    outs = {}
    while eng.has_unfinished():
        for o in eng.step():
            outs[o.request_id] = o
    return outs[rid]


def test_multi_turn_session_prefills_only_the_new_part(dense1):
    turn1 = rand(0, 21)
    ref1 = reference(dense1, [turn1])[0]
    turn2 = turn1 + ref1 + rand(1, 5)
    ref2 = reference(dense1, [turn2])[0]

    results = {}
    for on in (False, True):
        eng = Engine(dense1, config(prefix_cache=on))
        o1 = _run(eng, turn1)
        pf1 = eng.stats.prefill_tokens
        o2 = _run(eng, turn2)
        results[on] = (o1.token_ids, o2.token_ids, eng.stats.prefill_tokens - pf1, eng.stats)
    for on in (False, True):
        assert results[on][0] == ref1 and results[on][1] == ref2
    off, on = results[False][3], results[True][3]
    assert off.prefix_hit_tokens == 0 and results[False][2] == len(turn2)
    # turn 1 computed the KV of prompt + all its output but the last token: 21 + 7 = 28 = 7 full pages
    assert on.prefix_hit_tokens == 28
    assert results[True][2] == len(turn2) - 28
    assert on.prefix_query_tokens == (len(turn1) - 1) + (len(turn2) - 1)


def test_siblings_share_system_prompt_pages(dense1):
    system = rand(2, 26)  # 6 full pages + 2 tokens
    prompts = [system + rand(3 + i, 3 + 2 * i) for i in range(3)]
    ref = reference(dense1, prompts)
    eng = Engine(dense1, config(prefix_cache=True))
    assert _run(eng, prompts[0]).token_ids == ref[0]
    ids = [eng.add_request(p, GREEDY) for p in prompts[1:]]
    reqs = [eng.requests[i] for i in ids]
    outs = {}
    outs.update({o.request_id: o for o in eng.step()})
    assert all(r in eng.running for r in reqs)
    shared = reqs[0].seq.pages[:6]
    assert reqs[1].seq.pages[:6] == shared  # the same device pages in both tables
    assert all(eng.allocator.refcount(p) == 3 for p in shared)  # the cache's and each sibling's
    assert set(reqs[0].seq.pages[6:]).isdisjoint(reqs[1].seq.pages[6:])
    assert eng.stats.prefix_hit_tokens == 2 * 24
    while eng.has_unfinished():
        outs.update({o.request_id: o for o in eng.step()})
    assert [outs[i].token_ids for i in ids] == ref[1:]
    # all pages released but the cache's; evicting them all brings every refcount back to zero
    assert eng.allocator.num_free + eng.prefix_cache.num_pages == eng.allocator.num_pages
    eng.prefix_cache.evict(eng.allocator.num_pages)
    assert eng.allocator.num_free == eng.allocator.num_pages


def test_cache_salt(dense1):
    prompt = rand(4, 17)
    ref = reference(dense1, [prompt])[0]
    eng = Engine(dense1, config(prefix_cache=True))
    with pytest.raises(RequestError, match="cache_salt"):
        eng.add_request(prompt, GREEDY, cache_salt=3)
    assert _run(eng, prompt, cache_salt="a").token_ids == ref
    assert _run(eng, prompt, cache_salt="b").token_ids == ref
    assert eng.stats.prefix_hit_tokens == 0
    assert _run(eng, prompt).token_ids == ref  # no salt is a tenant of its own
    assert eng.stats.prefix_hit_tokens == 0
    assert _run(eng, prompt, cache_salt="a").token_ids == ref
    assert eng.stats.prefix_hit_tokens == 16


def test_memory_pressure_evicts_instead_of_preempting(dense1):
    # waves of 3 requests of 20 + 8 tokens (7 pages each); 24 pages fit one wave, not one wave plus the
    # cached pages of the previous one
    waves = [[rand(10 + 3 * w + i, 20) for i in range(3)] for w in range(3)]
    waves[2][0] = waves[0][0][:12] + rand(99, 8)  # shares 3 pages with a request two waves back
    refs = [reference(dense1, w) for w in waves]
    eng = Engine(dense1, config(prefix_cache=True, num_pages=24, max_seqs=3))
    for w, ref in zip(waves, refs):
        outs = eng.generate(w, GREEDY, progress=False)
        assert [o.token_ids for o in outs] == ref
    assert eng.stats.prefix_evicted_pages > 0
    assert eng.prefix_cache.stats.evicted_pages == eng.stats.prefix_evicted_pages
    assert eng.stats.preemptions == 0
    assert eng.allocator.num_free + eng.prefix_cache.num_pages == eng.allocator.num_pages


def test_tight_pool_with_preemption_still_matches(dense1):
    # a pool too small for everything at once: running requests grow into cached pages (evicted first)
    # and preemption, when it comes, recomputes through the cache
    system = rand(20, 16)
    ps = [system + rand(21 + i, 2 + 3 * i) for i in range(5)]
    ref = reference(dense1, ps, 12)
    eng = Engine(dense1, config(prefix_cache=True, num_pages=20, max_seqs=4))
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    assert [o.token_ids for o in eng.generate(ps[:1], params, progress=False)] == ref[:1]
    assert [o.token_ids for o in eng.generate(ps[1:], params, progress=False)] == ref[1:]
    assert eng.stats.prefix_hit_tokens > 0
    assert eng.stats.prefix_evicted_pages > 0 and eng.stats.preemptions > 0  # both paths ran
    assert eng.allocator.num_free + eng.prefix_cache.num_pages == eng.allocator.num_pages
    cached = eng.prefix_cache.num_pages
    assert eng.prefix_cache.evict(100) == cached
    assert eng.allocator.num_free == eng.allocator.num_pages


def test_step_failure_drops_the_cache(dense1, monkeypatch):
    # a failed step reallocates the pool: the cached KV is gone, so nothing may match it afterwards
    prompt = rand(30, 19)
    ref = reference(dense1, [prompt])[0]
    eng = Engine(dense1, config(prefix_cache=True))
    assert _run(eng, prompt).token_ids == ref
    assert eng.prefix_cache.num_pages > 0
    real = eng.runner.step
    calls = []

    def flaky(b):
        calls.append(1)
        if len(calls) == 1:
            raise RuntimeError("injected device failure")
        return real(b)

    monkeypatch.setattr(eng.runner, "step", flaky)
    eng.add_request(prompt, GREEDY)
    with pytest.raises(StepError):
        eng.step()
    assert eng.prefix_cache.num_pages == 0 and eng.allocator.num_free == eng.allocator.num_pages
    hits = eng.stats.prefix_hit_tokens
    outs = {}
    while eng.has_unfinished():
        outs.update({o.request_id: o for o in eng.step() if o.finished})
    assert [o.token_ids for o in outs.values()] == [ref]
    assert eng.stats.prefix_hit_tokens == hits  # recomputed, not matched against the lost pool


def test_protect_path_keeps_one_session_and_peek_changes_nothing():
    t = [0.0]
    alloc = PageAllocator(16)
    cache = PrefixCache(alloc, page_size=2, clock=lambda: t[0])
    # two sessions under one key share a 2-token system prompt: [9, 9] then their own pages
    for toks in ([9, 9, 1, 1, 1, 1], [9, 9, 2, 2]):
        pages = _seq(alloc, len(toks) // 2)
        cache.insert("k", toks, pages)
        alloc.free(pages)
    alloc.free(cache.match("k", [9, 9, 2, 2]))  # session 2 is now the more recently used
    stats = (cache.stats.queried_tokens, cache.stats.hit_tokens)
    assert cache.peek("k", [9, 9, 1, 1, 1, 1, 5]) == 6 and cache.peek("k", [9, 9, 3]) == 2
    assert cache.peek("other", [9, 9]) == 0
    assert (cache.stats.queried_tokens, cache.stats.hit_tokens) == stats and alloc.num_free == 16 - 4
    assert cache.protect_path("k", [9, 9, 1, 1, 1, 1], until=5.0) == 6
    # session 1 is the LRU but protected: session 2's own page goes first, then the shared prompt stays
    # (session 1 still hangs below it) and session 1's pages go only once nothing else is left
    assert cache.evict(1) == 1 and cache.peek("k", [9, 9, 2, 2]) == 2
    assert cache.peek("k", [9, 9, 1, 1, 1, 1]) == 6
    t[0] = 6.0  # protection lapsed: plain LRU again
    assert cache.evict(1) == 1 and cache.peek("k", [9, 9, 1, 1, 1, 1]) == 4


def test_pages_a_host_copy_holds_are_evicted_first():
    alloc = PageAllocator(8)
    cache = PrefixCache(alloc, page_size=1)
    for toks in ([1, 2], [3, 4]):
        pages = _seq(alloc, 2)
        cache.insert("k", toks, pages)
        alloc.free(pages)
    alloc.free(cache.match("k", [1, 2]))  # [3, 4] is the least recently used
    alive = [True]
    assert cache.mark_backed("k", [1, 2, 7], lambda: alive[0]) == 2  # a host copy holds [1, 2]: cheaper to lose
    assert cache.evict(1) == 1 and cache.peek("k", [1, 2]) == 1 and cache.peek("k", [3, 4]) == 2
    alive[0] = False  # the host copy was evicted: [1] costs a recompute now, and [3, 4] is older
    assert cache.evict(1) == 1 and cache.peek("k", [1, 2]) == 1 and cache.peek("k", [3, 4]) == 1
