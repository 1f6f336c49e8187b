"""Decode tokens/s of SmolLM2-135M-Instruct with and without a JSON schema, at batch 1 and 16.

One engine serves both sides (a grammar's masks ride in the same compiled step as an unconstrained
request's all-ones masks, so nothing is compiled for either). Each side generates answers to chat
prompts ("Describe <topic> as JSON."), greedy: plain with `max_tokens` tokens each (ignore_eos), the
constrained side under a schema of a list of records long enough that most answers reach
`max_tokens` too. tokens/s is the output tokens over the wall time of the batch; the sides take turns
rep by rep (common.interleave), best of --reps. The host time of the grammar masks per draw is
the engine's own count (EngineStats.grammar_mask_s over grammar_masks).

  .venv/bin/python -m benchmarks.structured_decode                 # batches 1 and 16
  .venv/bin/python -m benchmarks.structured_decode --reps=5 --max_tokens=128
"""
from __future__ import annotations

import json
import os
import time

from absl import app, flags

from benchmarks import common

_BATCHES = flags.DEFINE_list("batches", ["1", "16"], "Concurrent requests.")
_REPS = flags.DEFINE_integer("reps", 3, "Timed runs of each side (best of), interleaved.")
_MAX_TOKENS = flags.DEFINE_integer("max_tokens", 96, "Output tokens per request at most.")
_OUT = flags.DEFINE_string("out", None, "Write the results as JSON here.")

TOPICS = ["a library", "a city", "a band", "a garden", "a school", "a museum", "a river", "a market", "a team",
          "a forest", "a festival", "a ship", "a bakery", "a mountain", "a theatre", "a station"]


def main(argv):
    del argv
    import jax
    from absl import logging

    logging.set_verbosity(logging.WARNING)
    from talaria_jax.engine import Engine, EngineConfig, SamplingParams, enable_compilation_cache, grammar
    from talaria_jax.weights import load_model
    from talaria_jax.sharding import make_mesh

    enable_compilation_cache()
    batches = [int(b) for b in _BATCHES.value]
    lm = load_model("smollm2-135m-instruct", mesh=make_mesh(jax.devices()[:1]), dtype="float32")
    tok = lm.tokenizer
    machine = common.Machine.start(threads=os.cpu_count())
    eng = Engine(lm.model, EngineConfig(max_seqs=max(batches), max_tokens_per_step=256, max_model_len=1024,
                                        prefix_cache=False), tokenizer=tok)
    g = grammar.json_schema(common.RECORDS_SCHEMA)
    rows = []
    for b in batches:
        asks = [[{"role": "user", "content": f"Describe {TOPICS[i % len(TOPICS)]} as JSON."}] for i in range(b)]
        prompts = [tok.encode(tok.apply_chat_template(m)) for m in asks]
        plain = SamplingParams(max_tokens=_MAX_TOKENS.value, temperature=0.0, ignore_eos=True)
        constrained = SamplingParams(max_tokens=_MAX_TOKENS.value, temperature=0.0, grammar=g)
        tokens, masks = {}, {}

        def side(name, params):
            def run() -> float:
                st = eng.stats
                m0, s0 = st.grammar_masks, st.grammar_mask_s
                t0 = time.perf_counter()
                outs = eng.generate(prompts, params, progress=False)
                dt = time.perf_counter() - t0
                tokens[name] = sum(len(o.token_ids) for o in outs)
                if name == "json":
                    masks["n"], masks["s"] = st.grammar_masks - m0, st.grammar_mask_s - s0
                    for o in outs:
                        if o.finish_reason == "stop":
                            json.loads(o.text)  # a finished answer parses
                return dt / tokens[name]  # seconds per token: interleave keeps the lowest
            return run

        best = common.interleave({"plain": side("plain", plain), "json": side("json", constrained)}, _REPS.value)
        row = {"batch": b, "plain_tok_s": 1 / best["plain"], "json_tok_s": 1 / best["json"],
               "json_tokens": tokens["json"], "plain_tokens": tokens["plain"],
               "mask_us_per_draw": 1e6 * masks["s"] / max(masks["n"], 1)}
        row["ratio"] = row["json_tok_s"] / row["plain_tok_s"]
        rows.append(row)
        print(f"batch {b}: plain {row['plain_tok_s']:.1f} tok/s, json_schema {row['json_tok_s']:.1f} tok/s "
              f"(x{row['ratio']:.2f}), mask {row['mask_us_per_draw']:.0f} us per draw", flush=True)
    machine.stop()
    common.print_markdown_table(
        [("batch", "batch", "d"), ("plain tok/s", "plain_tok_s", ".1f"), ("json_schema tok/s", "json_tok_s", ".1f"),
         ("json / plain", "ratio", ".2f"), ("mask per draw (us)", "mask_us_per_draw", ".0f"),
         ("json tokens", "json_tokens", "d")], rows)
    print(machine.report())
    common.write_json(_OUT.value, {"rows": rows}, machine)


if __name__ == "__main__":
    app.run(main)
