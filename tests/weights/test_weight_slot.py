"""The weight slot: models of different shapes carved out of one preallocated device buffer whose
addresses never change, switched by staging (host-to-device, then device-to-device) or by a load."""
import dataclasses
import types
import warnings

import jax
import numpy as np
import pytest

from talaria_jax.engine.engine import Engine, EngineConfig
from talaria_jax.engine.sampling import SamplingParams
from talaria_jax.models import load_model_config
from talaria_jax.models.model import ShardedModel, abstract_model
from talaria_jax.sharding import make_mesh
from talaria_jax.weights.slot import HostWeights, SlotLayout, WeightSlot, carve, without_weights

GREEDY = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True, logprobs=5)
PROMPTS = [[7, 300, 42]]
# One sequence, one token per step: every step has the same shape, so each engine compiles once.
CFG = EngineConfig(warmup=False, page_size=8, max_seqs=1, max_tokens_per_step=1, max_model_len=32)
NAMES = ("tiny-dense", "tiny-moe")


def random_model(name: str, mesh, seed: int, **overrides) -> ShardedModel:
    """`name`'s config cut to 2 layers (tiny-moe: one dense, one MoE) with random parameters made in
    numpy and put straight into their shards: no init program to compile (several seconds each here)."""
    cfg = load_model_config(name).replace(num_layers=2, **overrides)
    graphdef, abstract, shardings = abstract_model(cfg, mesh)
    rng = np.random.default_rng(seed)

    def one(a, sharding):  # norm scales near 1, weights scaled by their first dim
        x = rng.standard_normal(a.shape)
        x = 1 + 0.1 * x if x.ndim == 1 else x / np.sqrt(a.shape[0])
        return jax.device_put(x.astype(a.dtype), sharding)

    state = jax.tree.map(one, abstract, shardings)
    return ShardedModel(cfg, mesh, graphdef, state, fingerprint=f"test-{name}-{seed}")


def generate(eng: Engine) -> list[tuple]:
    return [(o.token_ids, o.logprobs, o.top_logprobs) for o in eng.generate(PROMPTS, GREEDY, progress=False)]


def assert_same(got: list[tuple], want: list[tuple]) -> None:
    """Same tokens, and the chosen and top-5 logprobs (so the logits) within 1e-6."""
    for (ids, lp, top), (ids_w, lp_w, top_w) in zip(got, want, strict=True):
        assert ids == ids_w
        np.testing.assert_allclose(lp, lp_w, rtol=0, atol=1e-6)
        assert [list(t) for t in top] == [list(t) for t in top_w]
        np.testing.assert_allclose([list(t.values()) for t in top], [list(t.values()) for t in top_w],
                                   rtol=0, atol=1e-6)


def slot_engine(model, slot: WeightSlot) -> Engine:
    """An engine of `model` that can only read `slot`: the model it is given has no parameters."""
    eng = Engine(without_weights(model), CFG)
    eng.runner.use_slot(slot)
    return eng


@pytest.fixture(scope="module")
def four():
    """tiny-dense and tiny-moe on a 2x2 (ep, tp) mesh: their host weights, their outputs from plain
    engines, and one engine each reading a shared slot just big enough for the larger (warmed up)."""
    mesh = make_mesh(jax.devices()[:4], tp=2, ep=2)
    models = {n: random_model(n, mesh, seed=3) for n in NAMES}
    refs = {n: generate(Engine(m, CFG)) for n, m in models.items()}
    hosts = {n: HostWeights.of(m) for n, m in models.items()}
    slot = WeightSlot.for_layouts(mesh, [h.layout for h in hosts.values()])
    pointers = slot.pointers()
    engines = {n: slot_engine(m, slot) for n, m in models.items()}
    for eng in engines.values():
        eng.runner.warmup(progress=False)
    return types.SimpleNamespace(mesh=mesh, models=models, refs=refs, hosts=hosts, slot=slot, pointers=pointers,
                                 engines=engines)


def test_carved_matches_plain_on_one_device():
    model = random_model("tiny-dense", make_mesh(jax.devices()[:1]), seed=1)
    want = generate(Engine(model, CFG))
    host = HostWeights.of(model)
    slot = WeightSlot(model.mesh, host.layout.bytes_per_device)
    slot.load(host)
    assert_same(generate(slot_engine(model, slot)), want)


def test_carved_matches_plain_on_ep2_tp2(four):
    # experts split over ep, heads over tp, norms replicated: each device's row holds its own shards
    specs = [leaf.spec for leaf in four.hosts["tiny-moe"].layout.leaves]
    assert any("ep" in s for s in specs) and any("tp" in s for s in specs) and any(set(s) <= {None} for s in specs)
    assert four.hosts["tiny-dense"].data.sharding.memory_kind == "pinned_host"
    sizes = [h.layout.bytes_per_device for h in four.hosts.values()]
    assert sizes[0] != sizes[1] and four.slot.bytes_per_device == max(sizes)
    for name in NAMES:
        four.slot.load(four.hosts[name])
        assert_same(generate(four.engines[name]), four.refs[name])
        assert four.engines[name].runner.compilations == 1  # warm-up compiled the carved step serving used


def test_switching_models_keeps_slot_addresses(four):
    slot, hosts, engines = four.slot, four.hosts, four.engines
    slot.load(hosts[NAMES[0]])
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a "donated buffers were not usable" warning fails the test
        for i in range(20):
            cur, nxt = NAMES[i % 2], NAMES[(i + 1) % 2]
            staged = i % 4 < 2  # each model arrives both ways
            if staged:
                slot.stage(hosts[nxt])  # copies in while `cur` serves
            assert_same(generate(engines[cur]), four.refs[cur])
            if staged:
                slot.activate_staged()
            else:
                slot.load(hosts[nxt])
            assert slot.active is hosts[nxt]
            assert slot.pointers() == four.pointers
        assert_same(generate(engines[NAMES[0]]), four.refs[NAMES[0]])


def test_step_refuses_other_weights(four):
    slot, dense = four.slot, four.engines["tiny-dense"].runner
    slot.load(four.hosts["tiny-moe"])
    with pytest.raises(ValueError, match="holds tiny-moe .* not tiny-dense"):
        dense.step(dense.empty_batch(1))
    # same layout, other weights (another seed, another checkpoint): refused by fingerprint
    slot.load(dataclasses.replace(four.hosts["tiny-dense"], fingerprint="other"))
    with pytest.raises(ValueError, match=r"holds tiny-dense \(weights other\)"):
        dense.step(dense.empty_batch(1))
    slot.load(four.hosts["tiny-dense"])
    dense.step(dense.empty_batch(1))


def test_model_too_big_or_on_another_mesh(four):
    host = four.hosts["tiny-moe"]
    need = host.layout.bytes_per_device
    small = WeightSlot(four.mesh, need - 4096)
    msg = f"tiny-moe needs {need} bytes per device; the weight slot holds {need - 4096}"
    for put in (small.load, small.stage):
        with pytest.raises(ValueError, match=msg):
            put(host)
    assert small.active is None and small.staged is None
    with pytest.raises(ValueError, match=msg):
        Engine(without_weights(four.models["tiny-moe"]), CFG).runner.use_slot(small)
    other = WeightSlot(make_mesh(jax.devices()[4:8], tp=2, ep=2), need)
    with pytest.raises(ValueError, match=r"tiny-moe is on mesh .* devices \[0, 1, 2, 3\]; the slot .* \[4, 5, 6, 7\]"):
        other.load(host)
    with pytest.raises(ValueError, match="nothing is staged"):
        other.activate_staged()
    with pytest.raises(ValueError, match="tiny-moe is laid out in uint32 words; the slot holds uint16"):
        WeightSlot(four.mesh, need, np.uint16).stage(host)


def test_carve_in_any_word(four):
    # words narrower than the elements (f32 in bytes and halves), wider (bf16, two per word), and as
    # wide (the engine tests: f32 in uint32)
    bf16 = random_model("tiny-moe", four.mesh, seed=5, dtype="bfloat16")
    dense, moe = four.models.values()
    for model, word in [(dense, np.uint16), (moe, np.uint8), (bf16, np.uint32), (bf16, np.uint8)]:
        layout = SlotLayout.of(model, word=word)
        host = HostWeights.of(model, layout)
        flat = jax.device_put(host.data, WeightSlot(four.mesh, 64, word).sharding)
        got = jax.jit(carve, static_argnums=1)(flat, layout)
        for g, want in zip(jax.tree.leaves(got), jax.tree.leaves(model.state), strict=True):
            assert g.dtype == want.dtype and g.sharding.is_equivalent_to(want.sharding, g.ndim)
            np.testing.assert_array_equal(np.asarray(g), np.asarray(want))
    assert SlotLayout.of(bf16).word == np.uint16 and SlotLayout.of(four.models["tiny-moe"]).word == np.uint32


def test_layout_is_a_stable_static_arg(four):
    a, b = (SlotLayout.of(m) for m in four.models.values())
    assert SlotLayout.of(four.models["tiny-dense"]) == a and hash(SlotLayout.of(four.models["tiny-dense"])) == hash(a)
    assert a != b
    offsets = [leaf.offset for leaf in a.leaves]
    assert all(o % 64 == 0 for o in offsets) and offsets == sorted(offsets)
    assert all(x.offset + x.nbytes <= y.offset for x, y in zip(a.leaves, a.leaves[1:]))
