"""GGUF loading: tiny llama / qwen2 / qwen3 files written with gguf.GGUFWriter give the same logits as the
same weights saved as HF safetensors; our dequantization equals the gguf library's for every supported
type; malformed or unsupported files are refused by name.
"""
import json

import jax
import numpy as np
import pytest
from gguf import GGMLQuantizationType as T
from gguf import GGUFWriter
from gguf import quants as ref_quants
from safetensors.numpy import save_file

from talaria_jax.models.model import forward
from talaria_jax.sharding import make_mesh
from talaria_jax.weights import CheckpointError, config_from_gguf, load_gguf, load_hf_checkpoint
from talaria_jax.weights.gguf import BLOCKS, dequantize, gguf_fingerprint

EPS = 2.0 ** -20  # exact in fp32, so the GGUF (fp32) and config.json (fp64) epsilons are equal
TINY = dict(vocab=128, hidden=64, layers=2, heads=4, kv_heads=2, head_dim=16, ffn=128, theta=10000.0)
# K-quant rows hold 256 values, so the model that stores every matrix quantized is wider.
WIDE = dict(TINY, hidden=256, head_dim=64, ffn=256)
TOKENS = np.array([[5, 17, 99, 3, 64, 120, 7, 42, 1, 88, 31]], np.int32)
QUANTIZABLE = (T.BF16, T.Q4_0, T.Q4_1, T.Q5_0, T.Q5_1, T.Q8_0)  # gguf.quants.quantize implements these
K_QUANTS = (T.Q4_K, T.Q5_K, T.Q6_K)
# Byte offsets of each block's fp16 fields (scales and mins), from ggml's block structs.
FP16_FIELDS = {T.Q4_0: (0,), T.Q4_1: (0, 2), T.Q5_0: (0,), T.Q5_1: (0, 2), T.Q8_0: (0,),
               T.Q4_K: (0, 2), T.Q5_K: (0, 2), T.Q6_K: (208,)}

LAYER_NAMES = {"input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm",
               "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
               "self_attn.o_proj": "attn_output", "self_attn.q_norm": "attn_q_norm", "self_attn.k_norm": "attn_k_norm",
               "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up", "mlp.down_proj": "ffn_down"}


def gguf_name(hf: str) -> str:
    """llama.cpp's tensor name for an HF one (written out here, independent of the loader's table)."""
    top = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight",
           "lm_head.weight": "output.weight"}
    if hf in top:
        return top[hf]
    _, _, layer, rest = hf.split(".", 3)
    base, kind = rest.rsplit(".", 1)
    return f"blk.{layer}.{LAYER_NAMES[base]}.{kind}"


def permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """convert_hf_to_gguf.py's LlamaModel.permute: q/k rows reordered for ggml's interleaved RoPE."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def inverse_permute(stored: np.ndarray, n_head: int) -> np.ndarray:
    """HF rows from permuted ones, by inverting `permute`'s row index map (not the loader's formula)."""
    rows = permute(np.arange(stored.shape[0]), n_head)
    out = np.empty_like(stored)
    out[rows] = stored
    return out


def hf_weights(s: dict, rng, *, tie=False, bias=False, qk_norm=False) -> dict[str, np.ndarray]:
    """Random fp32 weights in HF layout; norms and biases are perturbed so that they matter."""
    e, h, kv, d, f = s["hidden"], s["heads"], s["kv_heads"], s["head_dim"], s["ffn"]
    w = {"model.embed_tokens.weight": rng.normal(0, 0.5, (s["vocab"], e)),
         "model.norm.weight": rng.normal(1, 0.1, e)}
    if not tie:
        w["lm_head.weight"] = rng.normal(0, 0.1, (s["vocab"], e))
    for i in range(s["layers"]):
        p = f"model.layers.{i}"
        w |= {f"{p}.input_layernorm.weight": rng.normal(1, 0.1, e),
              f"{p}.post_attention_layernorm.weight": rng.normal(1, 0.1, e),
              f"{p}.self_attn.q_proj.weight": rng.normal(0, 0.2, (h * d, e)),
              f"{p}.self_attn.k_proj.weight": rng.normal(0, 0.2, (kv * d, e)),
              f"{p}.self_attn.v_proj.weight": rng.normal(0, 0.2, (kv * d, e)),
              f"{p}.self_attn.o_proj.weight": rng.normal(0, 0.1, (e, h * d)),
              f"{p}.mlp.gate_proj.weight": rng.normal(0, 0.1, (f, e)),
              f"{p}.mlp.up_proj.weight": rng.normal(0, 0.1, (f, e)),
              f"{p}.mlp.down_proj.weight": rng.normal(0, 0.1, (e, f))}
        if bias:
            w |= {f"{p}.self_attn.{x}_proj.bias": rng.normal(0, 0.2, n * d)
                  for x, n in (("q", h), ("k", kv), ("v", kv))}
        if qk_norm:
            w |= {f"{p}.self_attn.{x}_norm.weight": rng.normal(1, 0.1, d) for x in ("q", "k")}
    return {k: v.astype(np.float32) for k, v in w.items()}


def random_blocks(qtype: T, rows: int, cols: int, rng, scale: float = 2e-3) -> np.ndarray:
    """Valid raw blocks [rows, bytes per row]: random bits, with small finite fp16 scales and mins."""
    per, nbytes = BLOCKS[qtype]
    raw = rng.integers(0, 256, (rows * cols // per, nbytes), dtype=np.uint8)
    for at in FP16_FIELDS[qtype]:
        raw[:, at:at + 2] = (rng.uniform(0.2, 1.0, (len(raw), 1)) * scale).astype(np.float16).view(np.uint8)
    return raw.reshape(rows, cols // per * nbytes)


def encode(x: np.ndarray, qtype: T, rng) -> tuple[np.ndarray, np.ndarray]:
    """(what to pass to add_tensor, the fp32 values the file then holds per the gguf library)."""
    if qtype == T.F32:
        return x, x
    if qtype == T.F16:
        return x.astype(np.float16), x.astype(np.float16).astype(np.float32)
    raw = ref_quants.quantize(x, qtype) if qtype in QUANTIZABLE else random_blocks(qtype, *x.shape, rng)
    return raw, ref_quants.dequantize(raw, qtype).astype(np.float32)


def write_gguf(path, arch: str, s: dict, weights: dict, types=lambda name, x: T.F32, rng=None, kv=None,
               extra_tensors=None) -> dict[str, np.ndarray]:
    """Writes a GGUF as llama.cpp's converter would (llama q/k permuted); returns the HF-layout fp32 values
    it holds (after quantization), the weights the HF reference must get."""
    rng = rng or np.random.default_rng(0)
    w = GGUFWriter(str(path), arch)
    w.add_block_count(s["layers"])
    w.add_context_length(256)
    w.add_embedding_length(s["hidden"])
    w.add_feed_forward_length(s["ffn"])
    w.add_head_count(s["heads"])
    w.add_head_count_kv(s["kv_heads"])
    w.add_rope_freq_base(s["theta"])
    w.add_layer_norm_rms_eps(EPS)
    w.add_vocab_size(s["vocab"])
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    if s["head_dim"] != s["hidden"] // s["heads"]:
        w.add_key_length(s["head_dim"])
        w.add_value_length(s["head_dim"])
    for key, val in (kv or {}).items():
        (w.add_float32 if isinstance(val, float) else w.add_uint32)(f"{arch}.{key}", val)
    held = {}
    for name, x in weights.items():
        n_head = {"q_proj": s["heads"], "k_proj": s["kv_heads"]}.get(name.split(".")[-2])
        permuted = arch == "llama" and n_head is not None
        stored = permute(x, n_head) if permuted else x
        qtype = types(gguf_name(name), stored) if stored.ndim == 2 else T.F32  # llama.cpp keeps 1-D tensors F32
        data, values = encode(stored, qtype, rng)
        w.add_tensor(gguf_name(name), data, raw_dtype=None if qtype in (T.F32, T.F16) else qtype)
        held[name] = inverse_permute(values, n_head) if permuted else values
    for name, (data, qtype) in (extra_tensors or {}).items():
        w.add_tensor(name, data, raw_dtype=qtype)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return held


def write_hf(folder, model_type: str, s: dict, weights: dict, **extra) -> None:
    folder.mkdir(parents=True, exist_ok=True)
    cfg = dict(model_type=model_type, vocab_size=s["vocab"], hidden_size=s["hidden"], num_hidden_layers=s["layers"],
               num_attention_heads=s["heads"], num_key_value_heads=s["kv_heads"], head_dim=s["head_dim"],
               intermediate_size=s["ffn"], rope_theta=s["theta"], rms_norm_eps=EPS, max_position_embeddings=256,
               tie_word_embeddings="lm_head.weight" not in weights, bos_token_id=1, eos_token_id=2, dtype="float32",
               **extra)
    (folder / "config.json").write_text(json.dumps(cfg))
    save_file(weights, folder / "model.safetensors")


def logits(model) -> np.ndarray:
    return np.asarray(forward(model, TOKENS))


def assert_same_logits(a, b):
    np.testing.assert_allclose(a, b, rtol=0, atol=1e-6 * np.abs(b).max())


# ---- models against the HF loader ---------------------------------------------------------------
VARIANTS = {  # name: (gguf arch, HF model_type and extra config.json keys, weight options, storage type)
    "llama": ("llama", ("llama", {}), {}, T.F32),
    "llama-tied": ("llama", ("llama", {}), {"tie": True}, T.F32),
    "llama-f16": ("llama", ("llama", {}), {}, T.F16),
    "llama-bf16": ("llama", ("llama", {}), {}, T.BF16),
    "llama-qkv-bias": ("llama", ("llama", {"attention_bias": True}), {"bias": True}, T.F32),
    # Qwen2 is Llama maths plus q/k/v biases; our HF loader reads it as llama with attention_bias.
    "qwen2": ("qwen2", ("llama", {"attention_bias": True}), {"bias": True}, T.F32),
    "qwen3": ("qwen3", ("qwen3", {}), {"qk_norm": True}, T.F32),
}


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_matches_hf_checkpoint_of_same_weights(variant, tmp_path):
    arch, (model_type, extra), opts, storage = VARIANTS[variant]
    s = dict(TINY, head_dim=32) if arch == "qwen3" else TINY  # qwen3: head_dim != hidden / heads (key_length)
    weights = hf_weights(s, np.random.default_rng(1), **opts)
    held = write_gguf(tmp_path / "m.gguf", arch, s, weights, types=lambda n, x: storage)
    write_hf(tmp_path / "hf", model_type, s, held, **extra)
    ours = load_gguf(tmp_path / "m.gguf", dtype="float32", progress=False)
    ref = load_hf_checkpoint(tmp_path / "hf", progress=False)
    assert ours.cfg.replace(name="x") == ref.cfg.replace(name="x")
    assert_same_logits(logits(ours), logits(ref))


def test_default_dtype_follows_storage(tmp_path):
    s = TINY
    weights = hf_weights(s, np.random.default_rng(2))
    for storage, want in ((T.BF16, "bfloat16"), (T.F32, "float32"), (T.Q8_0, "float32")):
        write_gguf(tmp_path / "m.gguf", "llama", s, weights, types=lambda n, x: storage)
        model = load_gguf(tmp_path / "m.gguf", progress=False)
        assert model.cfg.dtype == want, storage
        assert model.param_arrays()["blocks.0.attn.q_proj"].dtype == np.dtype(want)
    assert load_gguf(tmp_path / "m.gguf", dtype="bfloat16", progress=False).cfg.dtype == "bfloat16"


def test_every_quant_type_end_to_end(tmp_path):
    """A llama whose matrices use every supported type, against the HF loader given the values the file holds."""
    kinds = {"token_embd": T.Q8_0, "output": T.Q6_K, "attn_q": T.Q4_K, "attn_k": T.Q5_K, "attn_v": T.Q6_K,
             "attn_output": T.Q4_0, "ffn_gate": T.Q5_0, "ffn_up": T.Q5_1, "ffn_down": T.Q4_1}
    s = WIDE
    weights = hf_weights(s, np.random.default_rng(3))
    held = write_gguf(tmp_path / "q.gguf", "llama", s, weights, rng=np.random.default_rng(4),
                      types=lambda n, x: kinds[n.split(".")[-2]])
    write_hf(tmp_path / "hf", "llama", s, held)
    ours = load_gguf(tmp_path / "q.gguf", progress=False)
    assert ours.cfg.dtype == "float32"
    assert_same_logits(logits(ours), logits(load_hf_checkpoint(tmp_path / "hf", progress=False)))


def test_tensor_parallel_matches_one_device(tmp_path):
    weights = hf_weights(TINY, np.random.default_rng(5))
    write_gguf(tmp_path / "m.gguf", "llama", TINY, weights, types=lambda n, x: T.Q8_0)
    one = load_gguf(tmp_path / "m.gguf", progress=False)
    mesh = make_mesh(jax.devices()[4:8], tp=4)
    tp = load_gguf(tmp_path / "m.gguf", mesh, progress=False)
    q = tp.param_arrays()["blocks.0.attn.q_proj"]
    assert q.sharding.mesh == mesh and q.addressable_shards[0].data.shape == (TINY["hidden"], 1, TINY["head_dim"])
    np.testing.assert_allclose(logits(tp), logits(one), rtol=0, atol=1e-5 * np.abs(logits(one)).max())
    assert tp.fingerprint == one.fingerprint


def test_config_metadata_and_fingerprint(tmp_path):
    s = TINY
    weights = hf_weights(s, np.random.default_rng(6))
    write_gguf(tmp_path / "a.gguf", "llama", s, weights)
    cfg = config_from_gguf(tmp_path / "a.gguf")
    assert (cfg.name, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, cfg.norm_eps, cfg.max_position) == \
        ("a", 4, 2, 16, EPS, 256)
    assert (cfg.bos_token_id, cfg.eos_ids, cfg.tie_embeddings) == (1, (2,), False)
    a = load_gguf(tmp_path / "a.gguf", progress=False)
    assert a.fingerprint == load_gguf(tmp_path / "a.gguf", progress=False).fingerprint
    assert a.fingerprint != load_gguf(tmp_path / "a.gguf", dtype="bfloat16", progress=False).fingerprint
    weights["model.layers.1.mlp.up_proj.weight"][3, 5] += 1.0  # one weight changed, same shapes
    write_gguf(tmp_path / "b.gguf", "llama", s, weights)
    b = load_gguf(tmp_path / "b.gguf", progress=False)
    assert b.fingerprint != a.fingerprint
    assert gguf_fingerprint(tmp_path / "a.gguf") != gguf_fingerprint(tmp_path / "b.gguf")


def test_end_of_turn_ids_become_extra_eos(tmp_path):
    import gguf

    weights = hf_weights(TINY, np.random.default_rng(7))
    path = tmp_path / "m.gguf"
    w = GGUFWriter(str(path), "llama")
    for k, v in ((gguf.Keys.LLM.BLOCK_COUNT, 2), (gguf.Keys.LLM.EMBEDDING_LENGTH, 64), (gguf.Keys.LLM.VOCAB_SIZE, 128),
                 (gguf.Keys.LLM.FEED_FORWARD_LENGTH, 128), (gguf.Keys.Attention.HEAD_COUNT, 4),
                 (gguf.Keys.Attention.HEAD_COUNT_KV, 2)):
        w.add_uint32(k.format(arch="llama"), v)
    w.add_layer_norm_rms_eps(EPS)
    w.add_eos_token_id(2)
    w.add_eot_token_id(9)
    w.add_eom_token_id(2)  # equal to eos: not repeated
    for name, x in weights.items():
        w.add_tensor(gguf_name(name), x)
    w.write_header_to_file(), w.write_kv_data_to_file(), w.write_tensors_to_file(), w.close()
    cfg = config_from_gguf(path)
    assert cfg.eos_ids == (2, 9) and cfg.rope_theta == 10000.0


def test_vocab_from_token_list_and_per_layer_head_counts(tmp_path):
    import gguf

    path = tmp_path / "m.gguf"
    w = GGUFWriter(str(path), "qwen2")
    for k, v in ((gguf.Keys.LLM.BLOCK_COUNT, 2), (gguf.Keys.LLM.EMBEDDING_LENGTH, 64),
                 (gguf.Keys.LLM.FEED_FORWARD_LENGTH, 128), (gguf.Keys.Attention.HEAD_COUNT, 4)):
        w.add_uint32(k.format(arch="qwen2"), v)
    w.add_head_count_kv([2, 2])  # per layer, uniform
    w.add_layer_norm_rms_eps(EPS)
    w.add_token_list([f"t{i}" for i in range(100)])
    w.write_header_to_file(), w.write_kv_data_to_file(), w.write_tensors_to_file(), w.close()
    cfg = config_from_gguf(path)
    assert (cfg.vocab_size, cfg.num_kv_heads, cfg.attention_bias, cfg.qk_norm) == (100, 2, True, False)


# ---- dequantization against the gguf library ------------------------------------------------------
@pytest.mark.parametrize("qtype", [*QUANTIZABLE, *K_QUANTS], ids=lambda t: t.name)
def test_dequantize_matches_gguf_library(qtype):
    rng = np.random.default_rng(int(qtype))
    per = BLOCKS[qtype][0]
    rows, cols = 6, 2 * max(per, 256)
    if qtype in QUANTIZABLE:  # the library's own quantizer, from wide-range values
        raw = ref_quants.quantize(rng.normal(0, 3, (rows, cols)).astype(np.float32), qtype)
        np.testing.assert_array_equal(dequantize(raw, qtype, (rows, cols)), ref_quants.dequantize(raw, qtype))
    if qtype != T.BF16:  # random bits: every nibble, high bit, scale and min pattern
        raw = random_blocks(qtype, rows, cols, rng, scale=10.0)
        np.testing.assert_array_equal(dequantize(raw, qtype, (rows, cols)), ref_quants.dequantize(raw, qtype))


def test_block_sizes_match_gguf_constants():
    from gguf.constants import GGML_QUANT_SIZES

    assert {t: GGML_QUANT_SIZES[t] for t in BLOCKS} == BLOCKS


def test_dequantize_through_reader_all_types(tmp_path):
    """Each type written to a file and read back by GGUFReader (byte shapes, ggml-order dims)."""
    from gguf import GGUFReader

    rng = np.random.default_rng(8)
    x = rng.normal(0, 1, (3, 512)).astype(np.float32)
    w = GGUFWriter(str(tmp_path / "t.gguf"), "llama")
    want = {}
    for qtype in BLOCKS:
        data, want[qtype.name] = encode(x, qtype, rng)
        w.add_tensor(qtype.name, data, raw_dtype=None if qtype in (T.F32, T.F16) else qtype)
    w.write_header_to_file(), w.write_kv_data_to_file(), w.write_tensors_to_file(), w.close()
    for t in GGUFReader(tmp_path / "t.gguf").tensors:
        got = dequantize(t.data, t.tensor_type, tuple(reversed(t.shape.tolist())), t.name)
        np.testing.assert_array_equal(got, want[t.name], err_msg=t.name)


def test_q4_1_block_by_hand():
    d, m = 0.5, -1.0
    qs = np.array([j | ((15 - j) << 4) for j in range(16)], np.uint8)  # element j = j, element j+16 = 15-j
    block = np.concatenate([np.array([d, m], np.float16).view(np.uint8), qs])
    want = np.concatenate([0.5 * np.arange(16) - 1.0, 0.5 * np.arange(15, -1, -1) - 1.0])
    np.testing.assert_array_equal(dequantize(block, T.Q4_1, (32,)), want)
    assert dequantize(block, T.Q4_1, (32,))[[0, 15, 16, 31]].tolist() == [-1.0, 6.5, 6.5, -1.0]


def test_q6_k_block_by_hand():
    # ql bytes 0x21: low nibble 1, high nibble 2; qh bytes 0b11_10_01_00: 2-bit groups 0, 1, 2, 3;
    # scales sc[i] = i - 8; d = 0.25.
    scales = (np.arange(16) - 8).astype(np.int8).view(np.uint8)
    block = np.concatenate([np.full(128, 0x21, np.uint8), np.full(64, 0b11100100, np.uint8), scales,
                            np.array([0.25], np.float16).view(np.uint8)])
    y = dequantize(block, T.Q6_K, (256,))
    # Value i = 128 h + 32 g + l takes a low nibble (g < 2) or high nibble, plus 2-bit group g, minus 32,
    # times scale 8 h + 2 g + l // 16: q per group = 1 - 32, 1 + 16 - 32, 2 + 32 - 32, 2 + 48 - 32.
    q = {0: -31, 1: -15, 2: 2, 3: 18}
    i = np.arange(256)
    h, g, l = i // 128, i % 128 // 32, i % 32
    want = 0.25 * (8 * h + 2 * g + l // 16 - 8) * np.vectorize(q.get)(g)
    np.testing.assert_array_equal(y, want)
    assert y[[0, 16, 32, 64, 96, 128, 255]].tolist() == [62.0, 54.25, 22.5, -2.0, -9.0, 0.0, 31.5]


# ---- refusals -------------------------------------------------------------------------------------
def test_truncated_file_is_refused(tmp_path):
    write_gguf(tmp_path / "m.gguf", "llama", TINY, hf_weights(TINY, np.random.default_rng(9)))
    data = (tmp_path / "m.gguf").read_bytes()
    for cut in (len(data) - 1000, 200, 10):  # inside the tensor data, the metadata, the magic/version
        (tmp_path / "t.gguf").write_bytes(data[:cut])
        with pytest.raises(CheckpointError, match=r"t\.gguf.*(truncated|cannot be parsed)"):
            load_gguf(tmp_path / "t.gguf", progress=False)
    with pytest.raises(CheckpointError, match="does not exist"):
        load_gguf(tmp_path / "missing.gguf", progress=False)


def test_unknown_architecture_is_refused(tmp_path):
    write_gguf(tmp_path / "m.gguf", "gemma2", TINY, hf_weights(TINY, np.random.default_rng(10)))
    with pytest.raises(CheckpointError, match=r"architecture 'gemma2' is not supported.*'llama', 'qwen2', 'qwen3'"):
        load_gguf(tmp_path / "m.gguf", progress=False)


@pytest.mark.parametrize("qtype", [T.Q2_K, T.Q3_K, T.IQ2_XXS], ids=lambda t: t.name)
def test_unsupported_tensor_type_is_refused(qtype, tmp_path):
    from gguf.constants import GGML_QUANT_SIZES

    per, nbytes = GGML_QUANT_SIZES[qtype]
    s = WIDE
    weights = {k: v for k, v in hf_weights(s, np.random.default_rng(11)).items() if "1.mlp.up_proj" not in k}
    raw = np.zeros((s["ffn"], s["hidden"] // per * nbytes), np.uint8)  # ffn_up [ffn, hidden] in that type
    write_gguf(tmp_path / "m.gguf", "llama", s, weights, extra_tensors={"blk.1.ffn_up.weight": (raw, qtype)})
    with pytest.raises(CheckpointError, match=rf"'blk\.1\.ffn_up\.weight'.*{qtype.name} is not supported"):
        load_gguf(tmp_path / "m.gguf", progress=False)


@pytest.mark.parametrize("kv, match", [({"expert_count": 8}, r"llama\.expert_count=8"),
                                        ({"attention.sliding_window": 64}, r"llama\.attention\.sliding_window=64"),
                                        ({"rope.scaling.factor": 8.0}, r"llama\.rope\.scaling\.factor=8\.0"),
                                        ({"rope.dimension_count": 8}, r"llama\.rope\.dimension_count=8")])
def test_unsupported_metadata_is_refused(kv, match, tmp_path):
    write_gguf(tmp_path / "m.gguf", "llama", TINY, hf_weights(TINY, np.random.default_rng(12)), kv=kv)
    with pytest.raises(CheckpointError, match=match):
        config_from_gguf(tmp_path / "m.gguf")


def llama3_rope_factors(head_dim: int, theta: float, factor: float, low: float, high: float, old: int) -> np.ndarray:
    """convert_hf_to_gguf.py's rope_freqs for Llama-3 scaling (written out here, not the decoder's code):
    1 for high frequencies, `factor` for low ones, a smooth blend between."""
    out = []
    for f in 1.0 / theta ** (np.arange(0, head_dim, 2) / head_dim):
        wavelen = 2 * np.pi / f
        if wavelen < old / high:
            out.append(1.0)
        elif wavelen > old / low:
            out.append(factor)
        else:
            smooth = (old / wavelen - low) / (high - low)
            out.append(1 / ((1 - smooth) / factor + smooth))
    return np.array(out, np.float32)


def test_llama3_rope_freqs_match_hf_rope_scaling(tmp_path):
    """GGUF stores Llama-3 RoPE scaling as per-frequency divisors; the HF config as rope_scaling. Same logits."""
    s = dict(TINY, theta=500000.0)
    scaling = dict(rope_type="llama3", factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
                   original_max_position_embeddings=64)  # small: the tiny head's frequencies span all three regimes
    factors = llama3_rope_factors(s["head_dim"], s["theta"], 8.0, 1.0, 4.0, 64)
    assert len(set(factors.tolist())) > 2
    weights = hf_weights(s, np.random.default_rng(15))
    held = write_gguf(tmp_path / "m.gguf", "llama", s, weights,
                      extra_tensors={"rope_freqs.weight": (factors, None)})
    write_hf(tmp_path / "hf", "llama", s, held, rope_scaling=scaling)
    ours = load_gguf(tmp_path / "m.gguf", progress=False)
    assert ours.cfg.rope_freq_factors == tuple(factors.tolist())
    tokens = np.arange(200, dtype=np.int32)[None] % s["vocab"]  # long enough for the low frequencies to matter
    ref = load_hf_checkpoint(tmp_path / "hf", progress=False)
    theirs = np.asarray(forward(ref, tokens))
    np.testing.assert_allclose(np.asarray(forward(ours, tokens)), theirs, rtol=0, atol=1e-5 * np.abs(theirs).max())
    write_hf(tmp_path / "hf-unscaled", "llama", s, held)  # without the scaling the logits differ: the test can fail
    unscaled = np.asarray(forward(load_hf_checkpoint(tmp_path / "hf-unscaled", progress=False), tokens))
    assert np.abs(unscaled - theirs).max() > 1e-3 * np.abs(theirs).max()


def test_rope_freqs_unused_and_missing_tensors_are_refused(tmp_path):
    weights = hf_weights(TINY, np.random.default_rng(13))
    path = tmp_path / "m.gguf"
    write_gguf(path, "llama", TINY, weights, extra_tensors={"rope_freqs.weight": (np.ones(5, np.float32), None)})
    with pytest.raises(CheckpointError, match=r"'rope_freqs\.weight' has 5 factors; the head size 16 needs 8"):
        load_gguf(path, progress=False)
    write_gguf(path, "llama", TINY, weights, extra_tensors={"blk.0.attn_output.bias": (np.ones(64, np.float32), None)})
    with pytest.raises(CheckpointError, match=r"tensors this config does not use.*'blk\.0\.attn_output\.bias'"):
        load_gguf(path, progress=False)
    write_gguf(path, "llama", TINY, {k: v for k, v in weights.items() if "1.mlp.down_proj" not in k})
    with pytest.raises(CheckpointError, match=r"missing tensor 'blk\.1\.ffn_down\.weight'"):
        load_gguf(path, progress=False)


# ---- live: transformers reads the same files -------------------------------------------------------
@pytest.mark.hf
@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3"])
def test_live_transformers_reads_same_gguf(arch, tmp_path):
    """transformers' own GGUF reader (which undoes the llama permutation itself) gives our logits."""
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    # transformers' GGUF config reader ignores qwen3.attention.key_length and keeps Qwen3Config's head_dim 128.
    s = dict(TINY, head_dim=128) if arch == "qwen3" else TINY
    weights = hf_weights(s, np.random.default_rng(14), bias=arch == "qwen2", qk_norm=arch == "qwen3")
    write_gguf(tmp_path / "m.gguf", arch, s, weights, types=lambda n, x: T.Q8_0)
    hf = transformers.AutoModelForCausalLM.from_pretrained(tmp_path, gguf_file="m.gguf", dtype=torch.float32).eval()
    with torch.no_grad():
        theirs = hf(torch.tensor(TOKENS, dtype=torch.long)).logits.numpy()
    np.testing.assert_allclose(logits(load_gguf(tmp_path / "m.gguf", progress=False)), theirs, rtol=0,
                               atol=1e-4 * np.abs(theirs).max())
