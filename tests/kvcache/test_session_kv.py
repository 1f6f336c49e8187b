"""The session-KV owner, without a model: two models' prefix caches and host tiers over one arena, a
session's KV located on device and host in one answer, restored where a prompt extends it, protected
until a deadline on the owner's clock, replaced, forgotten, and cleared."""
import dataclasses

import jax
import pytest

from talaria_jax.kvcache.pool import KVArena
from talaria_jax.kvcache.session_kv import SessionKV
from talaria_jax.models import load_model_config
from talaria_jax.sharding import make_mesh

A = load_model_config("tiny-dense")
B = dataclasses.replace(A, name="tiny-other", num_layers=2)
TOKENS = list(range(100, 140))  # a session's context: 40 tokens, 5 full pages of 8 of model A


@pytest.fixture
def owned():
    arena = KVArena.for_models([A, B], make_mesh(jax.devices()[:1]), 8, num_pages=32)
    now = [0.0]
    sk = SessionKV(arena, clock=lambda: now[0])
    return sk, sk.add_model("a", A, weights="wa"), sk.add_model("b", B, weights="wb"), now


def cache(sk, kv, tenant, tokens):
    """A finished sequence's full pages left in `kv`'s prefix cache, as an engine leaves them."""
    pages = sk.arena.allocator.allocate(len(tokens) // kv.prefix_cache.page_size)
    kv.prefix_cache.insert(kv.key(tenant), tokens, pages)
    sk.arena.allocator.free(pages)
    return pages


def offload(sk, kv, tokens, session):
    pages = sk.arena.allocator.allocate(-(-len(tokens) // kv.prefix_cache.page_size))
    copy = kv.host_tier.offload(sk.arena.array, pages, tokens, session=session)
    sk.arena.allocator.free(pages)
    return copy


def test_locate_answers_device_and_host_at_once_per_model_and_tenant(owned):
    sk, a, b, _ = owned
    assert sk.locate("s", "a", "t1", TOKENS) == (0, 0) and sk.model_of("s") is None
    cache(sk, a, "t1", TOKENS[:24])
    sk.started("s", "a")
    sk.kept("s", "a", "t1", offload(sk, a, TOKENS, "s"))
    assert sk.model_of("s") == "a" and sk.with_host_copy() == {"s"}
    assert sk.locate("s", "a", "t1", TOKENS) == (24, 40)
    assert sk.locate("s", "a", "t2", TOKENS) == (0, 40)  # another tenant reads none of the device pages
    assert sk.locate("s", "b", "t1", TOKENS) == (0, 0)  # the copy is model a's KV
    sk.use_host = False
    assert sk.locate("s", "a", "t1", TOKENS) == (24, 0) and sk.restorable("s", "a", TOKENS + [1]) is None


def test_restorable_is_the_copy_s_longest_common_prefix_with_the_prompt_but_its_last_token(owned):
    sk, a, _, _ = owned
    sk.started("s", "a")
    sk.kept("s", "a", None, offload(sk, a, TOKENS, "s"))
    assert sk.restorable("s", "a", TOKENS + [7, 8]).num_tokens == 40
    assert sk.restorable("s", "a", TOKENS).num_tokens == 39  # the prompt's last token is computed, not restored
    assert sk.restorable("s", "a", TOKENS[:5] + [0] + TOKENS[6:]).num_tokens == 5
    assert sk.restorable("s", "a", [0] + TOKENS) is None and sk.restorable("other", "a", TOKENS) is None


def test_protection_keeps_the_session_s_pages_until_its_deadline_on_the_owner_s_clock(owned):
    sk, a, _, now = owned
    cache(sk, a, "t1", TOKENS)
    cache(sk, a, "t1", list(range(500, 540)))  # another session's pages, under the same tenant
    sk.protect("s", 10.0, "t1", TOKENS)  # no call ran here yet: nothing to protect
    assert sk.protected() == []
    sk.started("s", "a")
    sk.kept("s", "a", "t1", offload(sk, a, TOKENS, "s"))
    sk.protect("s", 10.0, "t1", TOKENS)
    assert sk.protected() == [("s", "a")] and "s" in sk.budget.protected
    assert a.prefix_cache.evict(5) == 5  # the unprotected pages go first
    assert sk.device_tokens("a", "t1", TOKENS) == 40 and sk.device_tokens("a", "t1", range(500, 540)) == 0
    now[0] = 10.0
    sk.expire()
    assert sk.protected() == [] and "s" not in sk.budget.protected
    a.prefix_cache.evict(5)
    assert sk.device_tokens("a", "t1", TOKENS) == 0


def test_a_session_protected_on_two_models_keeps_each_deadline_and_its_host_copies_until_the_last(owned):
    sk, a, b, now = owned
    for model, until in (("a", 10.0), ("b", 20.0)):
        sk.started("s", model)
        sk.kept("s", model, None, offload(sk, a if model == "a" else b, TOKENS, "s"))
        sk.protect("s", until, None, TOKENS)
    assert sorted(sk.protected()) == [("s", "a"), ("s", "b")]
    now[0] = 10.0
    sk.expire()
    assert sk.protected() == [("s", "b")] and "s" in sk.budget.protected
    now[0] = 20.0
    sk.expire()
    assert sk.protected() == [] and "s" not in sk.budget.protected


def test_a_new_copy_replaces_the_same_models_last_and_forget_releases_them_all(owned):
    sk, a, b, _ = owned
    sk.started("s", "a")
    first = offload(sk, a, TOKENS[:16], "s")
    sk.kept("s", "a", None, first)
    sk.started("s", "b")  # the session's next call ran on model b: a's copy stays, b has its own
    second = offload(sk, b, TOKENS, "s")
    sk.kept("s", "b", None, second)
    assert a.host_tier.usable(first) and b.host_tier.usable(second)
    assert sk.locate("s", "a", None, TOKENS)[1] == 16 and sk.locate("s", "b", None, TOKENS)[1] == 40
    sk.started("s", "a")
    third = offload(sk, a, TOKENS, "s")
    sk.kept("s", "a", None, third)  # a's next copy replaces a's last one
    assert not a.host_tier.usable(first) and a.host_tier.usable(third) and b.host_tier.usable(second)
    sk.protect("s", 5.0, None, TOKENS)
    sk.forget("s")
    assert not b.host_tier.usable(second) and not a.host_tier.usable(third)
    assert sk.with_host_copy() == set() and sk.model_of("s") is None
    assert sk.protected() == [] and "s" not in sk.budget.protected


def test_every_model_s_copies_share_one_host_budget(owned):
    sk, a, b, _ = owned
    if a.host_tier.memory_kind is None:
        pytest.skip("no host memory kind on this backend: each tier keeps its own device grant")
    sk.started("s", "a")
    sk.kept("s", "a", None, offload(sk, a, TOKENS, "s"))
    one = sk.budget.used_bytes
    sk.budget.capacity_bytes = one  # room for one copy, of either model
    sk.started("r", "b")
    sk.kept("r", "b", None, offload(sk, b, TOKENS, "r"))
    assert sk.host_copy("s", "a") is None and sk.host_copy("r", "b") is not None  # a's copy made room
    assert sk.budget.evictions == 1


def test_clear_forgets_every_session_and_empties_every_cache(owned):
    sk, a, b, _ = owned
    cache(sk, a, None, TOKENS)
    cache(sk, b, None, TOKENS)
    sk.started("s", "a")
    sk.kept("s", "a", None, offload(sk, a, TOKENS, "s"))
    sk.protect("s", 99.0, None, TOKENS)
    sk.clear()
    assert sk.arena.allocator.num_free == 32 and a.prefix_cache.num_pages == b.prefix_cache.num_pages == 0
    assert sk.with_host_copy() == set() and sk.protected() == [] and sk.budget.num_copies == 0
    with pytest.raises(ValueError, match="already has its KV homes"):
        sk.add_model("a", A, weights="wa")
    assert sk.locate("s", "a", None, TOKENS) == (0, 0)
