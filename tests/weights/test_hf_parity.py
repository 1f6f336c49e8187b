"""Logits and greedy parity with HF transformers on tiny random Llama, Qwen3, Qwen3-MoE, GLM-4.5-MoE and gpt-oss.

Goldens come from tests/assets/make_golden.py; when torch + transformers are importable the HF
model is also rebuilt and run live.
"""
import json
import pathlib

import numpy as np
import pytest

from talaria_jax.models.model import forward, greedy_generate, pad_batch
from talaria_jax.weights import load_hf_checkpoint

ASSETS = pathlib.Path(__file__).resolve().parents[1] / "assets"
MODELS = ["hf-tiny-llama", "hf-tiny-qwen3", "hf-tiny-qwen3-moe", "hf-tiny-glm4-moe", "hf-tiny-gpt-oss"]
RTOL = 1e-4


def rel_err(a, b):
    return float(np.abs(a - b).max() / np.abs(b).max())


def our_logits(model, prompts):
    tokens, positions = pad_batch(prompts, max(map(len, prompts)))
    logits = np.asarray(forward(model, tokens, positions))
    return [logits[i, : len(p)] for i, p in enumerate(prompts)]


@pytest.fixture(scope="module", params=MODELS)
def loaded(request):
    d = ASSETS / request.param
    return request.param, load_hf_checkpoint(d, progress=False), json.loads((d / "prompts.json").read_text()), \
        np.load(d / "golden.npz")


def test_logits_match_golden(loaded):
    name, model, prompts, golden = loaded
    for i, got in enumerate(our_logits(model, prompts)):
        assert rel_err(got, golden[f"logits_{i}"]) <= RTOL, name


def test_greedy_32_tokens_match_golden(loaded):
    name, model, prompts, golden = loaded
    assert greedy_generate(model, prompts, 32) == golden["greedy"].tolist(), name


@pytest.mark.hf
@pytest.mark.parametrize("name", MODELS)
def test_live_against_transformers(name, tmp_path):
    pytest.importorskip("torch")
    pytest.importorskip("transformers")
    import sys

    sys.path.insert(0, str(ASSETS))
    import make_golden

    hf_model = make_golden.build_hf_model(name)
    prompts = make_golden.prompts()
    hf_logits, _ = make_golden.hf_logits_and_greedy(hf_model, prompts[:1])
    hf_model.save_pretrained(tmp_path / name)  # a fresh export, not the stored asset
    ours = load_hf_checkpoint(tmp_path / name, progress=False)
    assert rel_err(our_logits(ours, prompts[:1])[0], hf_logits[0]) <= RTOL


def test_paged_engine_greedy_matches_golden(loaded):
    from talaria_jax.engine import Engine, EngineConfig, SamplingParams

    name, model, prompts, golden = loaded
    eng = Engine(model, EngineConfig(page_size=4, max_seqs=3, max_tokens_per_step=16, max_model_len=64,
                                     warmup=False))
    outs = eng.generate(prompts, SamplingParams(max_tokens=32, temperature=0.0, ignore_eos=True), progress=False)
    assert [o.token_ids for o in outs] == golden["greedy"].tolist(), name


def test_unsupported_hf_fields_are_refused(tmp_path):
    import shutil

    from safetensors.numpy import load_file, save_file

    from talaria_jax.weights import CheckpointError

    d = tmp_path / "m"
    shutil.copytree(ASSETS / "hf-tiny-llama", d)
    cfg = json.loads((d / "config.json").read_text())
    (d / "config.json").write_text(json.dumps(dict(cfg, hidden_act="gelu")))
    with pytest.raises(CheckpointError, match="hidden_act='gelu'"):
        load_hf_checkpoint(d, progress=False)
    (d / "config.json").write_text(json.dumps(dict(cfg, eos_token_id=[2, 7])))
    tensors = load_file(d / "model.safetensors")
    assert load_hf_checkpoint(d, progress=False).cfg.eos_ids == (2, 7)
    save_file(dict(tensors, **{"model.layers.0.mlp.up_proj.bias": np.zeros(128, np.float32)}), d / "model.safetensors")
    with pytest.raises(CheckpointError, match=r"bias tensors the config does not use.*up_proj\.bias"):
        load_hf_checkpoint(d, progress=False)
