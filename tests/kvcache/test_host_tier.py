"""The host tier: pages out to host memory and back into other pages of the donated pool."""
import dataclasses
import gc
import logging
import warnings

import jax
import numpy as np
import pytest

from talaria_jax.engine.engine import Engine, EngineConfig
from talaria_jax.engine.sampling import SamplingParams
from talaria_jax.kvcache import host_tier as host_tier_module
from talaria_jax.kvcache.host_tier import (HostBudget, HostBudgetError, HostKVEvicted, HostTier, KVSource,
                                           NoHostMemory, padded_page_counts)
from talaria_jax.kvcache.pool import PoolSpec, allocate_pool, buffer_pointers, pool_spec, read_pages
from talaria_jax.models import greedy_generate, init_model, load_model_config
from talaria_jax.sharding import make_mesh


def _filled_pool(spec, mesh, seed=0):
    """A pool whose every element is distinct (written through the tier's own donated scatter)."""
    tier = HostTier(spec, mesh)
    pool = allocate_pool(spec, mesh)
    rng = np.random.RandomState(seed)
    shape = (spec.num_layers, 2, spec.num_pages, spec.page_size, spec.kv_heads, spec.head_dim)
    full = rng.randn(*shape).astype(np.float32)
    data = jax.device_put(full, tier.device_sharding)
    with jax.set_mesh(mesh):
        pool = tier.scatter(pool, data, np.arange(spec.num_pages, dtype=np.int32))
    return pool, full


def _host(pool, spec, mesh):
    """The pool's pages as [layers, 2, pages, page_size, kv_heads, head_dim]."""
    pages = np.asarray(read_pages(pool, spec, mesh, np.arange(spec.num_pages)))
    return pages.reshape(spec.num_pages, spec.num_layers, 2, *pages.shape[2:]).transpose(1, 2, 0, 3, 4, 5)


def test_pages_round_trip_through_host_memory_on_a_tp4_mesh():
    mesh = make_mesh(jax.devices()[4:8], tp=4)
    spec = pool_spec(load_model_config("tiny-dense"), 4, mesh, num_pages=12)
    pool, full = _filled_pool(spec, mesh)
    tier = HostTier(spec, mesh)
    before = buffer_pointers(pool)
    kv = tier.offload(pool, [3, 7, 1, 9], range(10))  # 10 tokens use 3 pages of 4: page 9 is not copied
    assert kv.num_pages == 3 and kv.num_tokens == 10 and kv.data.shape[2] == 4  # padded to a power of two
    assert kv.data.sharding.memory_kind == tier.memory_kind == "pinned_host"  # the CPU backend has it too
    assert kv.nbytes == 3 * spec.page_bytes
    assert not np.asarray(kv.data)[:, :, 3].any()  # the padding page is zeros, not another sequence's KV
    with warnings.catch_warnings():
        warnings.filterwarnings("error", message="Some donated buffers were not usable")
        pool = tier.restore(pool, kv, [5, 0, 11])
    assert buffer_pointers(pool) == before
    got = _host(pool, spec, mesh)
    want = full.copy()
    want[:, :, [5, 0, 11]] = full[:, :, [3, 7, 1]]
    np.testing.assert_array_equal(got, want)  # bit-exact, and every other page untouched


def test_restore_checks_the_destination():
    mesh = make_mesh(jax.devices()[:1])
    spec = pool_spec(load_model_config("tiny-dense"), 4, mesh, num_pages=8)
    pool, _ = _filled_pool(spec, mesh)
    tier = HostTier(spec, mesh)
    kv = tier.offload(pool, [1, 2], range(5))
    with pytest.raises(ValueError, match="holds 2 pages but 3 destination pages"):
        tier.restore(pool, kv, [3, 4, 5])
    other = HostTier(dataclasses.replace(spec, kv_heads=2), mesh)  # another model's layout
    with pytest.raises(ValueError, match="kv_heads 4 vs 2"):
        other.restore(allocate_pool(other.spec, mesh), kv, [3, 4])
    with pytest.raises(ValueError, match="does not fit this pool"):  # a copy whose data was swapped
        tier.restore(pool, dataclasses.replace(kv, data=kv.data[:, :, :1]), [3, 4])
    with pytest.raises(ValueError, match="5 tokens need 2 pages of 4, got 1"):
        tier.offload(pool, [1], range(5))


def test_copies_carry_their_source_and_a_mismatch_names_it():
    mesh = make_mesh(jax.devices()[:1])
    spec = pool_spec(load_model_config("tiny-dense"), 4, mesh, num_pages=8)
    pool, _ = _filled_pool(spec, mesh)
    tier = HostTier(spec, mesh, model="tiny-dense", weights="aaa")
    kv = tier.offload(pool, [1, 2], range(5))
    assert kv.source == KVSource("tiny-dense", "aaa", 4, spec.num_layers, spec.kv_heads, spec.head_dim, "float32")
    HostTier(spec, mesh, model="tiny-dense", weights="aaa").check(kv)  # same weights and layout, another tier
    with pytest.raises(ValueError, match="weights 'aaa' vs 'bbb'"):
        HostTier(spec, mesh, model="tiny-dense", weights="bbb").check(kv)
    with pytest.raises(ValueError, match="model 'tiny-dense' vs 'other'.*weights 'aaa' vs 'bbb'"):
        HostTier(spec, mesh, model="other", weights="bbb").check(kv)


def test_warmup_compiles_every_padded_page_count():
    mesh = make_mesh(jax.devices()[:1])
    spec = pool_spec(load_model_config("tiny-dense"), 4, mesh, num_pages=24)
    assert padded_page_counts(1) == (1,) and padded_page_counts(5) == (1, 2, 4, 8)
    pool, full = _filled_pool(spec, mesh)
    tier = HostTier(spec, mesh)
    pool = tier.warmup(pool, 5)
    assert tier.compilations == 2 * 4
    np.testing.assert_array_equal(_host(pool, spec, mesh), full)  # all padding: nothing read or written
    for pages in ([1], [2, 3], [4, 5, 6], [7, 8, 9, 10, 11]):
        pool = tier.restore(pool, tier.offload(pool, pages, range(4 * len(pages))), pages)
    assert tier.compilations == 2 * 4


def _shard_bytes(kv):
    return sum(s.data.nbytes for s in kv.data.addressable_shards)


@pytest.mark.parametrize("kv_heads,tp,ep", [(4, 8, 1), (1, 8, 1), (4, 4, 2)])
def test_one_host_copy_where_the_pool_replicates_kv_heads(kv_heads, tp, ep):
    """4 or 1 kv heads on 8 TP ranks (or 4 heads split on TP=4 and replicated over EP=2): the pool holds
    every page on several devices, the host holds one copy split over them, and restores bit-exactly."""
    mesh = make_mesh(jax.devices(), tp=tp, ep=ep)
    spec = dataclasses.replace(pool_spec(load_model_config("tiny-dense"), 4, mesh, num_pages=12), kv_heads=kv_heads)
    pool, full = _filled_pool(spec, mesh)
    tier = HostTier(spec, mesh)
    assert tier.host_replicas == 1 and tier.device_sharding.spec != tier.host_sharding.spec
    before = buffer_pointers(pool)
    kv = tier.offload(pool, [3, 7, 1], range(12))
    assert kv.data.sharding.memory_kind == "pinned_host"
    assert kv.nbytes == 3 * spec.page_bytes
    # one copy of the 4 padded pages over all 8 devices, not one per device
    assert _shard_bytes(kv) == kv.host_bytes == 4 * spec.page_bytes == tier.used_bytes
    assert len(kv.data.addressable_shards) == 8
    with warnings.catch_warnings():
        warnings.filterwarnings("error", message="Some donated buffers were not usable")
        pool = tier.restore(pool, kv, [5, 0, 11])
    assert buffer_pointers(pool) == before
    want = full.copy()
    want[:, :, [5, 0, 11]] = full[:, :, [3, 7, 1]]
    np.testing.assert_array_equal(_host(pool, spec, mesh), want)


def test_host_copy_stays_replicated_when_nothing_divides_and_says_why(caplog):
    mesh = make_mesh(jax.devices(), tp=8)
    spec = PoolSpec(num_layers=3, num_pages=6, page_size=2, kv_heads=3, head_dim=6)
    with caplog.at_level(logging.WARNING):
        tier = HostTier(spec, mesh, model="odd")
    assert "stay replicated 8x: tp=8 divides none of head_dim 6, page_size 2, kv_heads 3, layers 3" in caplog.text
    pool, full = _filled_pool(spec, mesh)
    kv = tier.offload(pool, [4], range(2))
    assert tier.host_replicas == 8 and kv.host_bytes == _shard_bytes(kv) == 8 * spec.page_bytes
    pool = tier.restore(pool, kv, [0])
    want = full.copy()
    want[:, :, 0] = full[:, :, 4]
    np.testing.assert_array_equal(_host(pool, spec, mesh), want)


def _tier_and_pool(**pages):
    """A tier on one device whose byte limits are given in pages (`capacity_bytes=3`: 3 pages' bytes)."""
    mesh = make_mesh(jax.devices()[:1])
    spec = pool_spec(load_model_config("tiny-dense"), 4, mesh, num_pages=8)
    pool, full = _filled_pool(spec, mesh)
    return HostTier(spec, mesh, **{k: v * spec.page_bytes for k, v in pages.items()}), pool, full, spec.page_bytes


def test_budget_evicts_the_least_recently_used_and_refuses_what_does_not_fit():
    tier, pool, full, pb = _tier_and_pool(capacity_bytes=3)
    assert tier.capacity_bytes == 3 * pb and tier.used_bytes == 0
    a = tier.offload(pool, [1], range(4), session="s1")
    b = tier.offload(pool, [2], range(4), session="s2")
    c = tier.offload(pool, [3], range(4), session="s1")
    assert tier.used_bytes == 3 * pb and tier.bytes_by_session() == {"s1": 2 * pb, "s2": pb}
    pool = tier.restore(pool, a, [0])  # a is now the most recently used: b is the oldest
    d = tier.offload(pool, [4], range(4))
    assert b.evicted and not (a.evicted or c.evicted or d.evicted) and tier.evictions == 1
    assert tier.bytes_by_session() == {"s1": 2 * pb, None: pb} and tier.used_bytes == 3 * pb
    for call in (lambda: tier.check(b), lambda: tier.restore(pool, b, [0])):
        with pytest.raises(HostKVEvicted, match="evicted to stay within the host budget"):
            call()
    assert b.data.is_deleted() and not tier.usable(b)
    tier.protect("s1")  # a and c go last: d goes next, though c is older
    e = tier.offload(pool, [5], range(4), session="s3")
    assert d.evicted and not c.evicted and tier.bytes_by_session() == {"s1": 2 * pb, "s3": pb}
    with pytest.raises(HostBudgetError, match=f"copy of {4 * pb} bytes does not fit the host budget of {3 * pb} "
                                              f"bytes"):
        tier.offload(pool, [4, 5, 6, 7], range(16))  # larger than the whole budget
    assert not e.evicted and tier.evictions == 2  # nothing was evicted for a copy that could not fit
    h = tier.offload(pool, [6, 7], range(8))  # e (unprotected), then c (protected, older than a) make room
    assert e.evicted and c.evicted and not a.evicted and tier.evictions == 4
    assert tier.bytes_by_session() == {"s1": pb, None: 2 * pb}
    tier.release(a)
    tier.release(a)  # idempotent
    with pytest.raises(ValueError, match="released"):
        tier.check(a)
    assert tier.bytes_by_session() == {None: 2 * pb}
    del h
    gc.collect()  # a copy nobody holds any more leaves the budget
    assert tier.bytes_by_session() == {}
    tier.protect("s1", False)
    c = tier.offload(pool, [3], range(4), session="s1")
    f = tier.offload(pool, [6, 7], range(8))
    g = tier.offload(pool, [2], range(4))
    assert c.evicted and tier.used_bytes == 3 * pb == f.host_bytes + g.host_bytes
    pool = tier.restore(pool, f, [0, 1])
    want = full.copy()
    want[:, :, [0, 1]] = full[:, :, [6, 7]]
    np.testing.assert_array_equal(_host(pool, tier.spec, tier.mesh), want)


def test_tiers_that_share_a_budget_evict_each_others_copies_and_release_only_their_own():
    """An instance's models share one HostBudget: one bound in bytes whatever the instance hosts."""
    tier, pool, _, pb = _tier_and_pool()
    budget = HostBudget(2 * pb)
    a_tier = HostTier(tier.spec, tier.mesh, model="a", budget=budget)
    b_tier = HostTier(tier.spec, tier.mesh, model="b", budget=budget)
    a1 = a_tier.offload(pool, [1], range(4), session="s1")
    b1 = b_tier.offload(pool, [2], range(4), session="s2")
    assert a_tier.used_bytes == b_tier.used_bytes == budget.used_bytes == 2 * pb and budget.num_copies == 2
    b2 = b_tier.offload(pool, [3], range(4), session="s3")  # the oldest copy of either tier goes
    assert a1.evicted and not (b1.evicted or b2.evicted) and budget.evictions == a_tier.evictions == 1
    a2 = a_tier.offload(pool, [4], range(4), session="s4")
    assert b1.evicted and budget.used_bytes == 2 * pb
    b_tier.release_all()  # b's weights changed: only b's copies go
    assert not a_tier.usable(b2) and a_tier.usable(a2) and budget.used_bytes == pb


def test_a_copy_that_fails_to_arrive_evicts_nobody(monkeypatch):
    tier, pool, _, pb = _tier_and_pool(capacity_bytes=1)
    a = tier.offload(pool, [1], range(4))

    def lost(*args):
        raise RuntimeError("host memory exhausted in transfer")

    monkeypatch.setattr(tier, "gather", lost)
    with pytest.raises(RuntimeError, match="exhausted"):
        tier.offload(pool, [2], range(4))  # would evict a, but the copy never arrives
    assert not a.evicted and tier.usable(a) and tier.evictions == 0 and tier.used_bytes == pb


def test_no_host_memory_kind_means_a_granted_device_budget_or_nothing(monkeypatch):
    monkeypatch.setattr(host_tier_module, "host_memory_kind", lambda mesh: None)
    tier, pool, full, pb = _tier_and_pool()
    assert tier.memory_kind is None and tier.capacity_bytes == 0
    with pytest.raises(NoHostMemory, match=r"cpu backend offers no host memory kind .*device_fallback_bytes"):
        tier.offload(pool, [1], range(4))
    assert tier.used_bytes == 0
    tier, pool, full, pb = _tier_and_pool(device_fallback_bytes=2, capacity_bytes=10)
    assert tier.capacity_bytes == 2 * pb  # the device grant bounds it
    a = tier.offload(pool, [1], range(4))
    assert a.data.sharding.memory_kind == "device" and a.host_bytes == tier.used_bytes == pb
    b = tier.offload(pool, [2], range(4))
    c = tier.offload(pool, [3], range(4))
    assert a.evicted and tier.used_bytes == 2 * pb
    with pytest.raises(HostBudgetError, match=f"device memory granted .* of {2 * pb} bytes"):
        tier.offload(pool, [1, 2, 3], range(12))
    pool = tier.restore(pool, c, [0])
    want = full.copy()
    want[:, :, 0] = full[:, :, 3]
    np.testing.assert_array_equal(_host(pool, tier.spec, tier.mesh), want)


def test_engine_recomputes_an_evicted_restore_and_counts_a_copy_over_budget():
    """An evicted copy passed as restore is accepted and its prefix recomputed (nothing is lost: the
    greedy output is the reference's), whether it was evicted before add_request or after."""
    model = init_model(load_model_config("tiny-dense"), make_mesh(jax.devices()[:1]), seed=1)
    eng = Engine(model, EngineConfig(page_size=4, max_seqs=2, max_tokens_per_step=32, max_model_len=64, warmup=False))
    greedy = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    rng = np.random.RandomState(0)
    p1, p2 = rng.randint(0, 256, 9).tolist(), rng.randint(0, 256, 11).tolist()

    def run(prompt, **kw):
        rid = eng.add_request(prompt, greedy, **kw)
        while eng.has_unfinished():
            done = {o.request_id: o for o in eng.step() if o.finished}
        return done[rid]

    first = run(p1, keep_kv=True)
    kv1 = first.kv
    eng.host_tier.capacity_bytes = kv1.host_bytes  # room for one copy
    kv2 = run(p2, keep_kv=True).kv
    assert kv1.evicted and not kv2.evicted and eng.host_tier.used_bytes == kv2.host_bytes
    turn2 = list(kv1.token_ids) + first.token_ids[-1:] + [7, 8, 9]
    out = run(turn2, restore=kv1)  # evicted before add_request: recomputed
    assert eng.stats.restored_tokens == 0
    assert out.token_ids == greedy_generate(model, [turn2], greedy.max_tokens)[0]
    turn2b = list(kv2.token_ids) + [1, 2]
    rid = eng.add_request(turn2b, greedy, restore=kv2)  # accepted while kv2 is alive...
    eng.host_tier.offload(eng.runner.kv, [0], range(4))  # ...then evicted before its step
    assert kv2.evicted
    done = {}
    while eng.has_unfinished():
        done.update({o.request_id: o for o in eng.step() if o.finished})
    assert eng.stats.restored_tokens == 0 and eng.stats.step_failures == 0
    assert done[rid].token_ids == greedy_generate(model, [turn2b], greedy.max_tokens)[0]
    eng.host_tier.capacity_bytes = kv2.host_bytes - 1  # no copy fits: the request finishes without its KV
    out = run(p1, keep_kv=True)
    assert out.kv is None and eng.stats.offload_failures == 1 and len(out.token_ids) == greedy.max_tokens


def test_restore_skip_leaves_the_first_pages_untouched():
    # a prefix cache holds the first page already (maybe shared): the restore writes only the rest
    mesh = make_mesh(jax.devices()[:2], tp=2)
    spec = pool_spec(load_model_config("tiny-dense"), 4, mesh, num_pages=8)
    pool, full = _filled_pool(spec, mesh)
    tier = HostTier(spec, mesh)
    kv = tier.offload(pool, [1, 2, 3], range(12))
    pool = tier.restore(pool, kv, [5, 6, 7], skip=1)
    want = full.copy()
    want[:, :, [6, 7]] = full[:, :, [2, 3]]  # page 5 keeps its own (sentinel) contents
    np.testing.assert_array_equal(_host(pool, spec, mesh), want)
    with pytest.raises(ValueError, match="skip=4 must be in"):
        tier.restore(pool, kv, [5, 6, 7], skip=4)
