"""Grammar-constrained decoding on the host: llguidance (Microsoft's Rust library behind Guidance,
also used by vLLM and SGLang) turns a request's grammar into a token mask for each draw.

A request's `SamplingParams.grammar` is an llguidance grammar: `json_schema(schema)`, `lark(text)` or
`regex(pattern)` make one. The engine keeps a `Constraint` per such request: before each draw the
mask of allowed tokens (int32 words, bit t of word t // 32 for token t; what the jitted sampler
reads), after it the drawn token. A draft chain is cut where the grammar refuses it and gets a mask
per node, so speculative decoding draws only what the grammar allows. The constraint follows the
request's output, which preemption and restores keep, so it survives both.
"""
from __future__ import annotations

import collections
import functools
import json
import threading
from collections.abc import Sequence
from typing import Any

import numpy as np

from talaria_jax.engine.errors import RequestError

__all__ = ["GrammarError", "Grammars", "Constraint", "json_schema", "lark", "regex", "mask_words"]


class GrammarError(RequestError):
    """A grammar (or schema) the library cannot compile; the message says what it refused."""


def _lib():
    import llguidance
    return llguidance


def json_schema(schema: dict | str) -> str:
    """The grammar of JSON text valid under `schema` (compact: no whitespace between tokens).

    Raises:
        GrammarError: `schema` is not a JSON object, or uses what the library cannot enforce (the
            message names it).
    """
    if isinstance(schema, str):
        try:
            schema = json.loads(schema)
        except ValueError as e:
            raise GrammarError(f"the JSON schema is not valid JSON: {e}") from None
    if not isinstance(schema, dict):
        raise GrammarError(f"a JSON schema must be an object, got {type(schema).__name__}")
    options = {"whitespace_flexible": False, "coerce_one_of": True}
    try:
        return _lib().LLMatcher.grammar_from_json_schema(schema, overrides=options)
    except (ValueError, TypeError) as e:
        raise GrammarError(f"the JSON schema: {e}") from None


def any_json() -> str:
    """The grammar of one JSON object (OpenAI's `json_object` response format)."""
    return json_schema({"type": "object"})


def lark(text: str) -> str:
    """The grammar of a Lark grammar (llguidance's dialect)."""
    return _lib().LLMatcher.grammar_from_lark(text)


def regex(pattern: str) -> str:
    """The grammar of text matching `pattern` whole."""
    return _lib().LLMatcher.grammar_from_regex(pattern)


def mask_words(vocab_size: int) -> int:
    """int32 words of a token mask over `vocab_size` logits."""
    return -(-vocab_size // 32)


class Constraint:
    """One request's grammar state (an llguidance matcher) over `vocab_size` logits."""

    def __init__(self, matcher, vocab_size: int):
        self._m, self.vocab_size = matcher, vocab_size
        self._words = mask_words(vocab_size)

    def allowed(self) -> np.ndarray:
        """int32 [W]: the tokens the grammar allows next (all clear once it is in error)."""
        out = np.zeros(self._words, np.int32)
        self._m.unsafe_compute_mask_ptr(out.ctypes.data, out.nbytes)
        return out

    def chain(self, tokens: Sequence[int]) -> np.ndarray:
        """int32 [n + 1, W] for n `tokens` the grammar allows in turn (cut them with `valid_prefix`):
        the mask before each of them and after the last. The grammar's state is left as it was.

        Raises:
            AssertionError: the grammar refuses one of `tokens` (a caller's error: cut them first).
        """
        n = len(tokens)
        out = np.zeros((n + 1, self._words), np.int32)
        self._m.unsafe_compute_mask_ptr(out[0].ctypes.data, out[0].nbytes)
        for j in range(n):
            if not self._m.consume_token(int(tokens[j])):  # the matcher is in error from here on
                raise AssertionError(f"chain: the grammar refuses token {int(tokens[j])} at {j} (cut the tokens "
                                     "with valid_prefix first)")
            self._m.unsafe_compute_mask_ptr(out[j + 1].ctypes.data, out[j + 1].nbytes)
        if n:
            self._m.rollback(n)
        return out

    def valid_prefix(self, tokens: Sequence[int]) -> int:
        """How many of `tokens`, in turn, the grammar allows."""
        return self._m.validate_tokens([int(t) for t in tokens]) if len(tokens) else 0

    def accept(self, token: int) -> bool:
        """Advances by a drawn token; False when the grammar refuses it (it is then in error)."""
        return self._m.consume_token(int(token))

    @property
    def error(self) -> str | None:
        return self._m.get_error() or None if self._m.is_error() else None

    @property
    def finished(self) -> bool:
        """The grammar is complete: nothing but the end of the output may follow."""
        return self._m.is_stopped()


class Grammars:
    """Constraints for one tokenizer (its llguidance tokenizer built once, on first use: about a
    second for a 50K vocabulary). A grammar is compiled once: the last `cache_size` compiled are
    kept, and each constraint starts from a copy (a request is checked by the server, then queued,
    with the same grammar; agents send the same tools call after call)."""

    def __init__(self, tokenizer: Any, vocab_size: int, eos_ids: Sequence[int], cache_size: int = 64):
        self.tokenizer, self.vocab_size, self.eos_ids = tokenizer, vocab_size, tuple(eos_ids)
        self.cache_size = cache_size
        self._compiled: collections.OrderedDict[str, Any] = collections.OrderedDict()
        self._mu = threading.Lock()

    @functools.cached_property
    def _lltok(self):
        return _ll_tokenizer(self.tokenizer, self.vocab_size, self.eos_ids)

    def check(self, grammar: str) -> None:
        """GrammarError naming what the library refuses in `grammar` (which is compiled and kept)."""
        self._matcher(grammar)

    def constraint(self, grammar: str) -> Constraint:
        """A new request's state under `grammar` (compiled once, then copied).

        Raises:
            GrammarError: `grammar` is not a grammar string, or the library refuses it.
        """
        return Constraint(self._matcher(grammar).deep_copy(), self.vocab_size)

    def _matcher(self, grammar: str):
        """`grammar`'s compiled matcher, at its start (never advanced: constraints are copies)."""
        if not isinstance(grammar, str) or not grammar:
            raise GrammarError(f"grammar must be a non-empty string, got {type(grammar).__name__}")
        with self._mu:
            m = self._compiled.get(grammar)
            if m is not None:
                self._compiled.move_to_end(grammar)
        if m is None:
            m = _lib().LLMatcher(self._lltok, grammar, log_level=0)
            if m.is_error():
                raise GrammarError(f"grammar: {m.get_error()}"[:500])
            with self._mu:
                self._compiled[grammar] = m
                while len(self._compiled) > self.cache_size:
                    self._compiled.popitem(last=False)
        return m


def _ll_tokenizer(tok: Any, vocab_size: int, eos_ids: Sequence[int]):
    """llguidance's view of a tokenizer: each id's bytes (special tokens as 0xFF + their text, which
    text never spells), the end-of-output ids, and the tokenizer itself for text the grammar forces."""
    ll = _lib()
    path = getattr(tok, "path", None)
    if path is not None and str(path).endswith("tokenizer.json"):  # tokenizers' own file: read as it is
        return ll.LLTokenizer(str(path), n_vocab=vocab_size, eos_token=list(eos_ids) or None)
    tokens = []
    for i in range(vocab_size):
        if i >= tok.vocab_size:
            tokens.append(b"")
            continue
        b = tok.token_bytes(i)
        tokens.append(b"\xff" + (b or f"<|special_{i}|>".encode()) if tok.is_special(i) else b)

    class _Wrapped:
        eos_token_id = eos_ids[0] if eos_ids else None
        bos_token_id = getattr(tok, "bos_id", None)
        special_token_ids = [i for i in range(min(vocab_size, tok.vocab_size)) if tok.is_special(i)]

        def __init__(self):
            self.tokens = tokens

        def __call__(self, data: bytes) -> list[int]:
            return tok.encode(data.decode("utf-8", "replace"))

    return ll.LLTokenizer(ll.TokenizerWrapper(_Wrapped()), n_vocab=vocab_size, eos_token=list(eos_ids) or None)
