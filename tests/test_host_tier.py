"""The host tier: pages out to host memory and back into other pages of the donated pool."""
import dataclasses
import warnings

import jax
import numpy as np
import pytest

from talaria_jax.kvcache.host_tier import HostTier, KVSource, padded_page_counts
from talaria_jax.kvcache.pool import allocate_pool, buffer_pointers, pool_spec
from talaria_jax.models import load_model_config
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
        pool = tier._scatter(pool, data, np.arange(spec.num_pages, dtype=np.int32))
    return pool, full


def _host(pool):
    return np.stack([np.stack([np.asarray(k), np.asarray(v)]) for k, v in pool])


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
    got = _host(pool)
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
    np.testing.assert_array_equal(_host(pool), full)  # all padding: nothing read or written
    for pages in ([1], [2, 3], [4, 5, 6], [7, 8, 9, 10, 11]):
        pool = tier.restore(pool, tier.offload(pool, pages, range(4 * len(pages))), pages)
    assert tier.compilations == 2 * 4
