"""Token-mask time of three grammar libraries on SmolLM2's vocabulary (49,152 tokens): llguidance
(the engine's, through `talaria_jax.engine.grammar`), xgrammar and outlines-core.

Each library compiles the same JSON schemas (the five of the agent tests: nested objects, arrays,
enums, numbers, required fields; and structured_decode's list of 20-40 records), then walks the
tokens of one valid compact answer per schema: before each token it writes the mask of allowed tokens
(the engine's int32 bit words; all three libraries write that layout), checks that the token is in it,
and advances. Mask time per draw is a walk's time over its draws; the libraries take turns rep by rep
(common.interleave), best of --reps. Compile time is a fresh compile (no cache) of each schema, and
vocabulary time the one-off build of the library's view of the tokenizer.

xgrammar and outlines-core are not dependencies of talaria_jax; install them to compare (xgrammar
imports torch and transformers):

  .venv/bin/pip install xgrammar outlines-core
  .venv/bin/python -m benchmarks.grammar_libraries --reps=5
"""
from __future__ import annotations

import json
import os
import time

import numpy as np
from absl import app, flags

from benchmarks import common

_REPS = flags.DEFINE_integer("reps", 5, "Timed walks of each library (best of), interleaved.")
_LIBS = flags.DEFINE_list("libraries", ["llguidance", "xgrammar", "outlines-core"], "Libraries to compare.")
_OUT = flags.DEFINE_string("out", None, "Write the results as JSON here.")

TEXT = {"type": "string", "maxLength": 40}
# (name, schema, a valid answer): the agent tests' five schemas (tests/serve/test_agent_api.py) and structured_decode's
CASES = [
    ("nested", {"type": "object", "properties": {"name": TEXT, "address": {
        "type": "object", "properties": {"city": TEXT, "country": TEXT}, "required": ["city", "country"]}},
        "required": ["name", "address"]},
     {"name": "Ada Lovelace", "address": {"city": "London", "country": "United Kingdom"}}),
    ("arrays", {"type": "object", "properties": {"items": {"type": "array", "items": TEXT, "maxItems": 5}},
                "required": ["items"]},
     {"items": ["apples", "bread", "milk", "eggs", "coffee"]}),
    ("enums", {"type": "object", "properties": {"mood": {"enum": ["happy", "sad", "calm"]}}, "required": ["mood"]},
     {"mood": "calm"}),
    ("numbers", {"type": "object", "properties": {"temperature": {"type": "number"}, "year": {
        "type": "integer", "minimum": 1900, "maximum": 2100}}, "required": ["temperature", "year"]},
     {"temperature": 21.5, "year": 2024}),
    ("required", {"type": "object", "properties": {"title": TEXT, "pages": {"type": "integer"},
                                                   "tags": {"type": "array", "items": TEXT, "maxItems": 3}},
                  "required": ["title", "pages", "tags"], "additionalProperties": False},
     {"title": "The Hobbit", "pages": 310, "tags": ["fantasy", "classic", "adventure"]}),
    ("records", common.RECORDS_SCHEMA,
     {"records": [{"name": f"item {k}", "year": 1990 + k, "tags": ["a", "b"][: k % 3]} for k in range(20)]}),
]


def _compact(value) -> str:
    return json.dumps(value, separators=(",", ":"))


class _Llguidance:
    """The engine's path: Grammars compiles a grammar once and starts each constraint from a copy."""

    def __init__(self, tok, vocab: int, eos: list[int]):
        from talaria_jax.engine import grammar
        self.grammar, self.g = grammar, grammar.Grammars(tok, vocab, eos)
        self.g.check(grammar.regex("x"))  # builds the library's tokenizer (the vocabulary time)

    def compile(self, schema: dict):
        text = self.grammar.json_schema(schema)
        self.g.check(text)
        return text

    def walk(self, compiled, tokens: list[int]) -> int:
        c = self.g.constraint(compiled)
        for t in tokens:
            assert _has(c.allowed(), t)
            c.accept(t)
        return len(tokens)


class _Xgrammar:
    def __init__(self, tok, vocab: int, eos: list[int]):
        import torch
        import xgrammar as xgr
        torch.set_num_threads(1)
        self.xgr = xgr
        words = [tok.token_bytes(i) if not tok.is_special(i) else b"" for i in range(tok.vocab_size)]
        self.info = xgr.TokenizerInfo(words, vocab_type=xgr.VocabType.RAW, vocab_size=vocab, stop_token_ids=eos)
        self.mask = xgr.allocate_token_bitmask(1, vocab)

    def compile(self, schema: dict):
        compiler = self.xgr.GrammarCompiler(self.info, max_threads=os.cpu_count(), cache_enabled=False)
        return compiler.compile_json_schema(json.dumps(schema), any_whitespace=False, separators=(",", ":"))

    def walk(self, compiled, tokens: list[int]) -> int:
        m = self.xgr.GrammarMatcher(compiled)
        for t in tokens:
            m.fill_next_token_bitmask(self.mask, 0)
            assert _has(self.mask[0].numpy(), t)
            assert m.accept_token(t)
        return len(tokens)


class _OutlinesCore:
    def __init__(self, tok, vocab: int, eos: list[int]):
        import outlines_core
        self.oc = outlines_core
        ids: dict[bytes, list[int]] = {}
        for i in range(tok.vocab_size):
            if not tok.is_special(i) and tok.token_bytes(i):
                ids.setdefault(tok.token_bytes(i), []).append(i)
        self.vocab = outlines_core.Vocabulary(eos[0], ids)
        from talaria_jax.engine.grammar import mask_words
        self.words = np.zeros(mask_words(vocab), np.int32)

    def compile(self, schema: dict):
        from outlines_core.json_schema import build_regex_from_schema
        return self.oc.Index(build_regex_from_schema(json.dumps(schema), whitespace_pattern=""), self.vocab)

    def walk(self, compiled, tokens: list[int]) -> int:
        g = self.oc.Guide(compiled)
        for t in tokens:
            g.write_mask_into(self.words.ctypes.data, self.words.size, 4)
            assert _has(self.words, t)
            g.advance(t, return_tokens=False)
        return len(tokens)


LIBRARIES = {"llguidance": _Llguidance, "xgrammar": _Xgrammar, "outlines-core": _OutlinesCore}


def _has(words: np.ndarray, t: int) -> bool:
    return bool((int(words[t // 32]) >> (t % 32)) & 1)


def main(argv):
    del argv
    from talaria_jax.tokenizer import load_tokenizer
    from talaria_jax.weights.named import named_model_path

    tok = load_tokenizer(named_model_path("smollm2-135m-instruct"))
    vocab, eos = tok.vocab_size, [tok.eos_id]
    streams = {name: tok.encode(_compact(answer)) for name, _, answer in CASES}
    machine = common.Machine.start(threads=1)
    libs, rows = {}, []
    for name in _LIBS.value:
        t0 = time.perf_counter()
        libs[name] = LIBRARIES[name](tok, vocab, eos)
        row = {"library": name, "vocab_s": time.perf_counter() - t0}
        compiled = {}
        for case, schema, _ in CASES:
            t0 = time.perf_counter()
            compiled[case] = libs[name].compile(schema)
            row[f"compile_ms_{case}"] = 1e3 * (time.perf_counter() - t0)
        row["compiled"] = compiled
        rows.append(row)
        print(f"{name}: vocabulary {row['vocab_s']:.2f} s, compile "
              + ", ".join(f"{c} {row[f'compile_ms_{c}']:.0f} ms" for c, _, _ in CASES), flush=True)

    def side(row):
        lib, compiled = libs[row["library"]], row["compiled"]

        def run() -> float:
            draws, t0 = 0, time.perf_counter()
            for case, _, _ in CASES:
                draws += lib.walk(compiled[case], streams[case])
            return (time.perf_counter() - t0) / draws
        return run

    best = common.interleave({row["library"]: side(row) for row in rows}, _REPS.value)
    machine.stop()
    base = best[rows[0]["library"]]
    for row in rows:
        del row["compiled"]
        row["mask_us"] = 1e6 * best[row["library"]]
        row["vs_first"] = best[row["library"]] / base
        row["compile_ms"] = sum(row[f"compile_ms_{c}"] for c, _, _ in CASES)
    print(f"{sum(map(len, streams.values()))} draws a walk over {len(CASES)} schemas; best of {_REPS.value}")
    common.print_markdown_table(
        [("library", "library", "s"), ("mask per draw (us)", "mask_us", ".0f"), (f"vs {rows[0]['library']}",
                                                                                  "vs_first", ".2f"),
         ("compile, 6 schemas (ms)", "compile_ms", ".0f"), ("records schema (ms)", "compile_ms_records", ".0f"),
         ("vocabulary (s)", "vocab_s", ".2f")], rows)
    print(machine.report())
    common.write_json(_OUT.value, {"rows": rows}, machine)


if __name__ == "__main__":
    app.run(main)
