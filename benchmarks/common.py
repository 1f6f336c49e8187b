"""Helpers shared by the benchmark scripts (run as `python benchmarks/NAME.py`, so this imports as `common`),
among them the measuring functions that both a benchmark script and benchmarks/device_check.py time
with: `prefill_tok_s` (engine_prefill.py), `ttft` and `copy_times` (host_restore.py), `switch_times`
(model_switch.py). Nothing here defines flags: a script passes its flag values in."""
from __future__ import annotations

import time

import numpy as np


def decode_with_synthetic_prefix(engine, batch: int, context: int, steps: int, warmup: int = 3) -> float:
    """Tokens/s of `steps` decode steps for `batch` sequences whose first `context` tokens count as
    already cached: their pages are held, their KV contents are whatever the pool holds, and only the
    last prompt token is computed. So only decode-shaped steps are timed (prefill is not measured)."""
    from talaria_jax.calibrate import start_synthetic_decode

    start_synthetic_decode(engine, batch, context, max_tokens=steps + warmup + 1)
    for _ in range(warmup):  # compile + warm-up
        engine.step()
    t = time.perf_counter()
    for _ in range(steps):
        engine.step()
    dt = time.perf_counter() - t
    assert all(len(r.output) == steps + warmup for r in engine.running), "a sequence finished early"
    return batch * steps / dt


def hf_config(hidden: int, layers: int) -> dict:
    return dict(vocab_size=32000, hidden_size=hidden, intermediate_size=hidden * 8 // 3 // 256 * 256 or 256,
                num_hidden_layers=layers, num_attention_heads=hidden // 64, num_key_value_heads=max(1, hidden // 192),
                head_dim=64, max_position_embeddings=4096, rms_norm_eps=1e-5, tie_word_embeddings=False)


def save_random_llama(path: str, config: dict) -> int:
    """Saves a randomly initialised fp32 HF Llama with `config` as safetensors; returns its parameter count."""
    import torch
    import transformers

    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**config)).float().eval()
    model.save_pretrained(path)
    return sum(p.numel() for p in model.parameters())


def print_markdown_table(columns: list[tuple[str, str, str]], rows: list[dict]) -> None:
    """Prints rows as a right-aligned markdown table; columns are (header, row key, format spec).
    A value that does not apply (None) prints as "-"."""
    print("\n| " + " | ".join(h for h, _, _ in columns) + " |")
    print("|" + "---:|" * len(columns))
    for r in rows:
        cells = ["-" if r[k] is None else format(r[k], f) for _, k, f in columns]
        print("| " + " | ".join(cells) + " |")


def best_time(fn, reps: int) -> float:
    """Best-of-`reps` seconds of `fn()` (blocked until its result is ready), after one untimed call."""
    import jax

    jax.block_until_ready(fn())
    best = float("inf")
    for _ in range(reps):
        t = time.perf_counter()
        jax.block_until_ready(fn())
        best = min(best, time.perf_counter() - t)
    return best


def prefill_tok_s(model, ctx: int, chunk: int, tile: int, reps: int, pages_per_block: int = 4) -> float:
    """Tokens/s of the one engine step that prefills `chunk` tokens over `ctx` cached ones (a synthetic
    prefix: its pages are held and count as computed), with query tiles of `tile` and
    `EngineConfig.pages_per_block`; best of `reps` after an untimed first run (it compiles)."""
    from talaria_jax.engine import Engine, EngineConfig, SamplingParams

    page = 16
    eng = Engine(model, EngineConfig(page_size=page, max_seqs=1, max_tokens_per_step=chunk, query_tile=tile,
                                     pages_per_block=pages_per_block,
                                     max_model_len=-(-(ctx + chunk + 8) // page) * page, warmup=False))
    rng = np.random.RandomState(0)
    times = []
    for _ in range(reps + 1):  # the first compiles
        rid = eng.add_request(rng.randint(0, model.cfg.vocab_size, ctx + chunk).tolist(),
                              SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True))
        req = eng.requests[rid]
        req.seq.grow(eng.allocator, ctx)
        req.num_computed = ctx
        eng.waiting.remove(req)
        eng.running.append(req)
        t = time.perf_counter()
        out = eng.step()
        times.append(time.perf_counter() - t)
        assert len(out) == 1 and out[0].finished, "the chunk did not fit one step"
    return chunk / min(times[1:])


def ttft(eng, prompt, restore=None) -> float:
    """Seconds from add_request of `prompt` (with `restore=`: its prefix KV restored from the host tier)
    to its first sampled token."""
    from talaria_jax.engine import SamplingParams

    t = time.perf_counter()
    rid = eng.add_request(prompt, SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True), restore=restore)
    while eng.has_unfinished():
        if any(o.request_id == rid and o.token_ids for o in eng.step()):
            break
    return time.perf_counter() - t


def copy_times(eng, kv, reps: int) -> dict:
    """Seconds of the tier's restore of `kv` into free pages and of its offload from them, and of a bare
    device_put of an array of the same shape between the same shardings, each way."""
    import jax

    tier = eng.host_tier
    pages = eng.allocator.allocate(kv.num_pages)  # free now (the engine is idle): held while timing

    def restore():
        eng.runner.kv = tier.restore(eng.runner.kv, kv, pages)
        return eng.runner.kv

    host = jax.device_put(np.ones(kv.data.shape, kv.data.dtype), tier.host_sharding)
    dev = jax.device_put(host, tier.transfer_sharding)
    try:
        return dict(restore_s=best_time(restore, reps),
                    h2d_s=best_time(lambda: jax.device_put(host, tier.transfer_sharding), reps),
                    offload_s=best_time(lambda: tier.offload(eng.runner.kv, pages, kv.token_ids).data, reps),
                    d2h_s=best_time(lambda: jax.device_put(dev, tier.host_sharding), reps))
    finally:
        eng.allocator.free(pages)


def switch_times(slot, hosts, restore, reps: int) -> dict[str, list[float]]:
    """Seconds per switch of a WeightSlot by each path, alternating the models of `hosts` (HostWeights):
    the stage() call, the staging copy from issue to arrival, activate_staged, load, and `restore()`
    (a function returning a Model, e.g. an Orbax restore). One untimed run of each first."""
    import jax

    out = {k: [] for k in ("stage_call", "stage_copy", "activate_staged", "load", "restore")}
    for i in range(reps + 1):
        host = hosts[i % len(hosts)]
        t = time.perf_counter()
        slot.stage(host)
        issued = time.perf_counter()
        slot.wait_staged()
        arrived = time.perf_counter()
        slot.activate_staged()
        slot.array.block_until_ready()
        switched = time.perf_counter()
        slot.load(hosts[(i + 1) % len(hosts)])
        slot.array.block_until_ready()
        loaded = time.perf_counter()
        jax.block_until_ready(restore().state)
        restored = time.perf_counter()
        if i:  # the first run compiles the in-place copy for each model size
            for k, dt in zip(out, (issued - t, arrived - t, switched - arrived, loaded - switched, restored - loaded)):
                out[k].append(dt)
    return out
