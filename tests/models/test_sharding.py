"""The same model on TP=8, on one device, and on a 4-device mesh of devices 4-7."""
import logging

import jax
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

from talaria_jax.models import greedy_generate, init_model, load_model_config
from talaria_jax.models.model import abstract_model, forward
from talaria_jax.sharding import make_mesh, rules, spec_for

PROMPTS = [[5, 17, 300, 42, 9], [256, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10], [77]]


def rel(a, b):
    return float(np.abs(a - b).max() / np.abs(b).max())


@pytest.fixture(scope="module", params=["tiny-dense", "tiny-moe"])
def cfg(request):
    return load_model_config(request.param)


def test_tp8_and_sub_mesh_match_one_device(cfg):
    tokens = np.random.RandomState(0).randint(0, cfg.vocab_size, (2, 24))
    one = init_model(cfg, make_mesh(jax.devices()[:1]), seed=7)
    ref = np.asarray(forward(one, tokens))
    ref_greedy = greedy_generate(one, PROMPTS, 12)
    meshes = [make_mesh(jax.devices(), tp=8), make_mesh(jax.devices()[4:], tp=4)]
    if cfg.moe:
        meshes.append(make_mesh(jax.devices()[4:], tp=2, ep=2))
    for mesh in meshes:
        m = init_model(cfg, mesh, seed=7)
        assert {d.id for d in m.state["embed"][...].devices()} == {d.id for d in mesh.devices.flat}
        assert rel(np.asarray(forward(m, tokens)), ref) <= 1e-5, dict(mesh.shape)
        assert greedy_generate(m, PROMPTS, 12) == ref_greedy, dict(mesh.shape)


def test_params_are_sharded_not_replicated(cfg):
    m = init_model(cfg, make_mesh(jax.devices(), tp=8), seed=0)
    q = m.state["blocks"][0]["attn"]["q_proj"][...]
    assert q.sharding.spec == P(None, "tp", None)
    assert q.addressable_shards[0].data.shape == (cfg.hidden_size, cfg.num_heads // 8, cfg.head_dim)
    # 4 kv heads on 8 ranks: kv heads stay whole (replicated).
    assert m.state["blocks"][0]["attn"]["k_proj"][...].sharding.spec == P(None, None, None)


def test_rules_table():
    mesh = make_mesh(jax.devices(), tp=4, ep=2)
    assert spec_for(("experts", "embed", "expert_mlp"), (8, 16, 32), mesh) == P("ep", None, "tp")
    assert spec_for(("embed", "kv_heads", "head_dim"), (16, 8, 4), mesh) == P(None, "tp", None)
    assert spec_for(("embed", "kv_heads", "head_dim"), (16, 2, 4), mesh) == P(None, None, None)
    with pytest.raises(KeyError, match="bogus"):
        spec_for(("bogus",), (4,), mesh)


def test_make_mesh_errors():
    with pytest.raises(ValueError, match=r"tp \(3\) x ep \(1\) must equal the number of devices \(8\)"):
        make_mesh(jax.devices(), tp=3)


def test_replication_is_logged_once_per_model_with_its_cost(monkeypatch, caplog):
    monkeypatch.setattr(rules, "_REPORTED", set())  # other tests may have sharded these models already
    cfg = load_model_config("tiny-dense")
    tp8, tp4 = make_mesh(jax.devices(), tp=8), make_mesh(jax.devices()[:4], tp=4)
    with caplog.at_level(logging.WARNING, logger="absl"):
        for _ in range(3):
            abstract_model(cfg, tp8)  # every loader and init_model shards the state like this
        abstract_model(cfg, tp4)  # 4 kv heads on 4 ranks: nothing replicated, nothing said
    logged = [r.getMessage() for r in caplog.records if "not divisible" in r.getMessage()]
    # k_proj and v_proj of 4 layers: 256 x 4 x 32 fp32 each, held whole instead of 1/8 per device
    extra = 2 * 4 * 256 * 4 * 32 * 4 * 7 / 8 / 2**20
    assert logged == [f"sharding on mesh {{'ep': 1, 'tp': 8}}: kv_heads 4 not divisible by tp=8: "
                      f"blocks.*.attn.k_proj, blocks.*.attn.v_proj replicated, +{extra:.2f} MiB per device"]
