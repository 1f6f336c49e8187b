"""The roofline cost model on hand-computable numbers, and its calibration to published figures."""
import dataclasses

import pytest

from talaria_jax.config_io import CONFIG_DIR
from talaria_jax.sim.cost import CostModel
from talaria_jax.sim.hardware import ConfigError, load_hardware, load_models
from talaria_jax.sim.toys import TOY_HW, toy_model

M = toy_model("m1")
C = CostModel(TOY_HW)


def test_prefill_is_compute_bound_by_hand():
    # 2e9 x 1000 linear + 4 x 1 layer x 1000 dim x mean ctx 500 x 1000 tokens = 2.002e12 FLOPs at 1e12/s
    assert C.prefill_s(M, 1000, 0) == pytest.approx(2.002)
    # on top of 1000 cached tokens the mean context is 1500
    assert C.prefill_s(M, 1000, 1000) == pytest.approx(2.006)
    assert C.prefill_s(M, 0, 5000) == 0.0


def test_batched_prefill_reads_the_weights_once():
    # two 10-token prompts: memory-bound, (10 GB of weights + 20 tokens x 1 MB) / 100 GB/s once,
    # not 0.1001 s each; two 1000-token prompts stay compute-bound, their FLOPs adding up
    assert C.prefill_batch_s(M, [(10, 0), (10, 0)]) == pytest.approx(0.1002)
    assert 2 * C.prefill_s(M, 10, 0) == pytest.approx(0.2002)
    assert C.prefill_batch_s(M, [(1000, 0), (1000, 0)]) == pytest.approx(4.004)
    assert C.prefill_batch_s(M, [(0, 100)]) == 0.0


def test_a_step_with_the_runners_tiles_is_priced_as_the_reference_runs_it():
    """With the runner's tiles, the step's KV is read once, every query tile walks the blocks of the
    step's longest sequence and the tokens are padded to the step's bucket; without them each
    sequence reads its own context."""
    from talaria_jax.engine.runner import TileRules

    rules = TileRules(max_tokens_per_step=256, max_seqs=8, page_size=16)
    tiled = CostModel(TOY_HW, rules)
    # two decoding sequences of 64 and 1,984 tokens: their 2,048 MB of KV read once, and two tiles of one
    # token, each visiting 124 pages (in 62 half blocks): (10 GB + 2,048 MB + 2 x 1,984 x 1 MB) / 100 GB/s,
    # where each reading its own is (10 GB + 2,048 MB) / 100 GB/s
    assert rules.walk([(1, 63), (1, 1983)]) == (2, 2, 1, 1984)
    assert tiled.prefill_batch_s(M, [(1, 63), (1, 1983)]) == pytest.approx(0.16016)
    assert C.prefill_batch_s(M, [(1, 63), (1, 1983)]) == pytest.approx(0.12048)
    # the walk at twice the weights' rate (mostly from cache) costs half as much
    fast = CostModel(dataclasses.replace(TOY_HW, tile_walk_efficiency=2.0), rules)
    assert fast.prefill_batch_s(M, [(1, 63), (1, 1983)]) == pytest.approx(0.14032)
    # a 100-token chunk after 1,000 cached beside three decoding sequences: 103 tokens in the 128 bucket,
    # 7 + 3 tiles of 16 needed, 15 run (the next tile count: the most any step of 128 tokens from 8
    # sequences can need, 8 + 120 / 16), each visiting 18 blocks of 64 tokens:
    # memory (10 GB + 1,163 MB + 15 x 1,152 x 1 MB) / 100 GB/s = 0.28443 s over compute (2e9 x 128 padded
    # tokens + 4 x 1000 x 15 tiles x 16 rows x 1,152 keys) / 1e12 = 0.25711 s
    chunks = [(1, 10), (1, 20), (1, 30), (100, 1000)]
    assert rules.walk(chunks) == (128, 15, 16, 1152)
    assert tiled.step_work(M, chunks) == pytest.approx((128, 1.163e9, 17.28e9, 2.56e11 + 1.10592e9, 1.10592e9))
    assert tiled.prefill_batch_s(M, chunks) == pytest.approx(0.28443)
    # one sequence's chunk is one tile of its bucket; under two tiles' worth, tiles of one token
    assert rules.walk([(256, 2048)]) == (256, 1, 256, 2304)
    assert rules.walk([(9, 2048)]) == (16, 16, 1, 2112)


def test_decode_step_is_memory_bound_by_hand():
    # (10 GB weights + 1000 tokens x 1 MB KV) / 100 GB/s
    assert C.decode_step_s(M, 1, 1000) == pytest.approx(0.11)
    assert C.decode_step_s(M, 0, 0) == 0.0


def test_decode_reads_kv_of_full_attention_layers_once():
    # kv_bytes_per_token counts full-attention layers only (gpt-oss: 36 KiB of 72), so a model whose
    # other layer has a short window reads the same (10 GB + 1000 x 1 MB) / 100 GB/s = 0.11 s
    w = dataclasses.replace(M, layers=2, full_attn_layers=1)
    assert C.decode_step_s(w, 1, 1000) == pytest.approx(0.11)


def test_copies_by_hand():
    assert C.weight_load_s(M) == pytest.approx(1.0)  # 10 GB over 10 GB/s
    assert C.d2d_weights_s(M) == pytest.approx(0.2)  # read + write 20 GB at 100 GB/s
    assert C.h2d_kv_s(M, 1000) == pytest.approx(0.1)  # 1 GB over 10 GB/s


def test_moe_decode_reads_only_touched_experts():
    shapes = load_models()
    q = shapes["qwen3-235b-a22b"]
    c = CostModel(load_hardware("h200x8"))
    assert c.expert_touch_fraction(q, 1) == pytest.approx(8 / 128)
    assert c.decode_step_s(q, 1, 0) < c.decode_step_s(q, 64, 0)


def test_prefill_calibrated_to_published_throughput():
    # docs/references.md: Qwen3-235B bf16 TP8 on 8xH100, 32K-input: 22.7K tokens/s
    c = CostModel(load_hardware("h100x8"))
    tps = c.saturated_prefill_tokens_per_s(load_models()["qwen3-235b-a22b"], 32768, 8)
    assert tps == pytest.approx(22_700, rel=0.1)


def test_switch_calibrated_to_sleep_mode_wake():
    # vLLM sleep-mode wake of Qwen3-235B-FP8 on 4 GPUs took 5.3-5.7 s on PCIe Gen4 (~half Gen5's rate):
    # on 8 Gen5 GPUs the same bytes per GPU count half as many per GPU and move twice as fast
    c = CostModel(load_hardware("h200x8"))
    t = c.weight_load_s(load_models()["qwen3-235b-a22b-fp8"])
    assert 5.3 / 4 * 0.9 < t < 5.7 / 4 * 1.1


@pytest.mark.parametrize("field,bad,match", [
    ("memory_utilization", "1.5", r"memory_utilization.*outside \[0.05, 1.0\]"),
    ("staging_step_slowdown", "0.5", r"field 'staging_step_slowdown'=0.5 outside \[1.0, 100.0\]")])
def test_bad_hardware_config_names_field(tmp_path, field, bad, match):
    p = tmp_path / "bad.yaml"
    good = (CONFIG_DIR / "hardware" / "h200x8.yaml").read_text()
    p.write_text("\n".join(f"{field}: {bad}" if line.startswith(f"{field}:") else line for line in good.splitlines()))
    with pytest.raises(ConfigError, match=match):
        load_hardware(p)
    p.write_text("\n".join(line for line in good.splitlines() if not line.startswith(f"{field}:")))
    with pytest.raises(ConfigError, match=f"missing field '{field}'"):
        load_hardware(p)
    with pytest.raises(ConfigError, match=r"'staging_step_slowdown'=0.9 must be a number in \[1.0, 100.0\]"):
        dataclasses.replace(TOY_HW, staging_step_slowdown=0.9)


def test_staging_step_slowdown_in_profiles():
    # GPUs copy on a copy engine over PCIe (free overlap); the CPU profile's staging copy slows decode
    assert load_hardware("h200x8").staging_step_slowdown == load_hardware("h100x8").staging_step_slowdown == 1.0
    assert load_hardware("cpu").staging_step_slowdown > 1.0
    assert TOY_HW.staging_step_slowdown == 1.0
