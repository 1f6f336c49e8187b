"""Sampling inside the jitted step: greedy, temperature, top-k, top-p, per-request seeds, logprobs.

Each row draws with its own key, fold_in(PRNGKey(seed), output_index), so a seeded request yields
the same tokens whatever else shares the batch (and after a preemption that recomputes it).
"""
from __future__ import annotations

import dataclasses
import functools
import numbers

import jax
import jax.numpy as jnp
import numpy as np

from talaria_jax.engine.errors import RequestError

MAX_TOP_LOGPROBS = 20  # OpenAI's limit for top_logprobs
MAX_LOGIT_BIAS = 300  # entries of a request's logit_bias (each step carries this many per row)


class SamplingError(RequestError):
    """A sampling parameter of the wrong type or out of range; the message names the field and the limit.
    A RequestError, so one `except RequestError` catches every bad request."""


def _is_int(x) -> bool:
    # bool is an int subclass, but True as a token count or seed is a caller's mistake
    return isinstance(x, numbers.Integral) and not isinstance(x, (bool, np.bool_))


def _is_real(x) -> bool:
    return isinstance(x, numbers.Real) and not isinstance(x, (bool, np.bool_))


def _kind(x) -> str:
    return f"{x!r} ({type(x).__name__})"


@dataclasses.dataclass(frozen=True)
class SamplingParams:
    """vLLM-style sampling parameters. temperature 0 is greedy."""
    max_tokens: int = 16
    temperature: float = 1.0
    top_k: int = 0  # 0 (or -1) = off
    top_p: float = 1.0
    seed: int | None = None
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    logprobs: int | None = None  # top-n logprobs per token, besides the chosen token's
    # (token id, bias) pairs added to the logits before drawing (OpenAI's logit_bias: [-100, 100])
    logit_bias: tuple[tuple[int, float], ...] = ()
    # an llguidance grammar the output must match (engine.grammar.json_schema / lark / regex make one)
    grammar: str | None = None

    def validate(self, vocab_size: int) -> None:
        """SamplingError (a RequestError) naming the field unless every field has its type and range:
        ints are ints (not bools, not floats: 2.5 is not silently truncated), floats are real numbers.

        Raises:
            SamplingError: a field of the wrong type or out of range, named with its limit.
        """
        for f in ("max_tokens", "top_k"):
            if not _is_int(getattr(self, f)):
                raise SamplingError(f"{f} must be an integer, got {_kind(getattr(self, f))}")
        for f in ("temperature", "top_p"):
            if not _is_real(getattr(self, f)):
                raise SamplingError(f"{f} must be a real number, got {_kind(getattr(self, f))}")
        for f in ("seed", "logprobs"):
            if getattr(self, f) is not None and not _is_int(getattr(self, f)):
                raise SamplingError(f"{f} must be an integer or None, got {_kind(getattr(self, f))}")
        if not isinstance(self.ignore_eos, (bool, np.bool_)):
            raise SamplingError(f"ignore_eos must be a bool, got {_kind(self.ignore_eos)}")
        if not isinstance(self.stop_token_ids, (tuple, list)):
            raise SamplingError(f"stop_token_ids must be a tuple or list of token ids, got "
                                f"{type(self.stop_token_ids).__name__}")
        for i, t in enumerate(self.stop_token_ids):
            if not _is_int(t):
                raise SamplingError(f"stop_token_ids[{i}] must be an integer token id, got {_kind(t)}")
        if self.max_tokens < 1:
            raise SamplingError(f"max_tokens must be >= 1, got {self.max_tokens}")
        if not 0.0 <= self.temperature <= 100.0:
            raise SamplingError(f"temperature must be in [0, 100], got {self.temperature}")
        if not (self.top_k in (-1, 0) or 1 <= self.top_k <= vocab_size):
            raise SamplingError(f"top_k must be -1, 0 or in [1, vocab_size={vocab_size}], got {self.top_k}")
        if not 0.0 < self.top_p <= 1.0:
            raise SamplingError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.logprobs is not None and not 0 <= self.logprobs <= MAX_TOP_LOGPROBS:
            raise SamplingError(f"logprobs must be in [0, {MAX_TOP_LOGPROBS}], got {self.logprobs}")
        if self.seed is not None and not 0 <= self.seed < 2**63:
            raise SamplingError(f"seed must be in [0, 2**63), got {self.seed}")
        bad = [t for t in self.stop_token_ids if not 0 <= t < vocab_size]
        if bad:
            raise SamplingError(f"stop_token_ids {bad} out of vocabulary [0, {vocab_size})")
        if self.grammar is not None and not (isinstance(self.grammar, str) and self.grammar):
            raise SamplingError(f"grammar must be a non-empty string or None, got {_kind(self.grammar)}")
        bias = self.logit_bias
        if not isinstance(bias, (tuple, list)) or len(bias) > MAX_LOGIT_BIAS:
            raise SamplingError(f"logit_bias must be a tuple of at most {MAX_LOGIT_BIAS} (token id, bias) pairs")
        for t, b in ((x[0], x[1]) if isinstance(x, (tuple, list)) and len(x) == 2 else (None, None) for x in bias):
            if not _is_int(t) or not 0 <= t < vocab_size:
                raise SamplingError(f"logit_bias token {t!r} is not a token id in [0, {vocab_size})")
            if not _is_real(b) or not -100.0 <= b <= 100.0:
                raise SamplingError(f"logit_bias of token {t} must be in [-100, 100], got {_kind(b)}")


@dataclasses.dataclass
class SamplingBatch:
    """Per-row arrays (host numpy) fed to `sample`."""
    temperature: np.ndarray  # f32 [R]
    top_k: np.ndarray        # i32 [R], 0 = off
    top_p: np.ndarray        # f32 [R]
    seed: np.ndarray         # u32 [R, 2] (hi, lo words of a 64-bit seed)
    step: np.ndarray         # i32 [R], index of the token being sampled in the request's output
    bias_ids: np.ndarray     # i32 [R, MAX_LOGIT_BIAS], logit_bias tokens (padding: token 0, bias 0)
    bias: np.ndarray         # f32 [R, MAX_LOGIT_BIAS]

    @classmethod
    def empty(cls, rows: int) -> "SamplingBatch":
        return cls(np.zeros(rows, np.float32), np.zeros(rows, np.int32), np.ones(rows, np.float32),
                   np.zeros((rows, 2), np.uint32), np.zeros(rows, np.int32),
                   np.zeros((rows, MAX_LOGIT_BIAS), np.int32), np.zeros((rows, MAX_LOGIT_BIAS), np.float32))

    def set_row(self, i: int, p: SamplingParams, seed: int, step: int) -> None:
        self.temperature[i] = p.temperature
        self.top_k[i] = max(p.top_k, 0)
        self.top_p[i] = p.top_p
        self.seed[i] = (seed >> 32) & 0xFFFFFFFF, seed & 0xFFFFFFFF
        self.step[i] = step
        if p.logit_bias:
            n = len(p.logit_bias)
            self.bias_ids[i, :n] = [t for t, _ in p.logit_bias]
            self.bias[i, :n] = [b for _, b in p.logit_bias]


def constrain(logits: jax.Array, row, bias_ids, bias, allowed, allowed_at):
    """The logits a draw reads: each row's logit bias added (`row` [L]: its sampling row) and the
    tokens its grammar mask clears at -inf. allowed: i32 [M, W] token masks (bit t % 32 of word
    t // 32; -1 words allow all), for the logits rows allowed_at [M] (out of range: none). Costs
    nothing when no row has a bias or a mask (lax.cond)."""
    def apply(lg):
        n, v = lg.shape
        lg = lg.at[jnp.arange(n)[:, None], bias_ids[row]].add(bias[row])
        words = jnp.full((n, allowed.shape[1]), -1, jnp.int32).at[allowed_at].set(allowed, mode="drop")
        tok = jnp.arange(v)
        keep = (jnp.right_shift(words[:, tok // 32], tok % 32) & 1) != 0
        return jnp.where(keep, lg, -jnp.inf)

    needed = jnp.any(allowed != -1) | jnp.any(bias != 0.0)
    return jax.lax.cond(needed, apply, lambda lg: lg, logits)


def order_keys(x: jax.Array) -> jax.Array:
    """uint32 keys of float32 values, in the values' order (-inf lowest, -0.0 equal to 0.0): the sign
    bit set for non-negative values, every bit flipped for negative ones."""
    x = x.astype(jnp.float32)
    b = jax.lax.bitcast_convert_type(jnp.where(x == 0.0, 0.0, x), jnp.uint32)
    return jnp.where((b >> 31) == 1, ~b, b | jnp.uint32(1 << 31))


def filter_logits(scaled: jax.Array, top_k, top_p) -> jax.Array:
    """scaled [R, V] with the logits outside each row's top-k / top-p set at -inf.

    Top-k keeps the values at least the k-th largest (ties to it included); top-p keeps the values at
    least the smallest value whose strictly larger values hold less than `top_p` of the mass (the
    smallest prefix of the sorted row reaching top_p, ties to its last value included, the top token
    always); top_k 0 and top_p >= 1 keep everything. Both thresholds are found without a sort, bit by
    bit over the values' order keys, highest bit first: 32 passes over the row for each filter some
    row uses, each a count (top-k, exact) or a masked sum (top-p: an fp32 sum of the mass above the
    threshold, or below it where top_p > 0.5, whichever is the smaller and so the nearer). On
    XLA:CPU the search is 7.5-29x faster than a sort of the vocabulary (docs/benchmarks/sampler.md).
    Under a mesh the logits are replicated first: one all-gather of the rows rather than a reduction
    across devices in each of the search's passes."""
    if not jax.sharding.get_abstract_mesh().empty:  # vocabulary-sharded logits (the TP LM head)
        scaled = jax.lax.with_sharding_constraint(scaled, jax.sharding.PartitionSpec())
    v = scaled.shape[-1]
    keys = order_keys(scaled)
    k = jnp.where(top_k > 0, jnp.minimum(top_k, v), v)[:, None]
    p = top_p[:, None]
    tail = p > 0.5  # these rows sum the mass below a threshold (<= 1 - top_p, exact in fp32): smaller, so nearer
    none = jnp.zeros((scaled.shape[0], 1), jnp.uint32)  # the lowest key: keeps every value

    def search(holds):
        """The largest key t of each row for which holds(t) (true at 0, monotone), bit by bit."""
        def bit(i, t):
            c = t | (jnp.uint32(1) << (31 - i).astype(jnp.uint32))
            return jnp.where(holds(c), c, t)
        return jax.lax.fori_loop(0, 32, bit, none)

    def at_least_k(c):  # >= k values at or above c
        return jnp.sum(keys >= c, axis=-1, keepdims=True) >= k

    def at_least_p(probs):
        def holds(c):  # >= top_p of the mass at or above c
            mass = jnp.sum(jnp.where((keys >= c) != tail, probs, 0.0), axis=-1, keepdims=True)
            return jnp.where(tail, mass <= 1.0 - p, mass >= p)
        return holds

    tk = jax.lax.cond(jnp.any(top_k > 0), lambda: search(at_least_k), lambda: none)
    tp = jax.lax.cond(jnp.any(top_p < 1.0), lambda: search(at_least_p(jax.nn.softmax(scaled, axis=-1))),
                      lambda: none)
    tp = jnp.where(p >= 1.0, none, tp)  # an fp32 mass may fall short of 1.0 before the tail ends
    return jnp.where(keys >= jnp.maximum(tk, tp), scaled, -jnp.inf)


def sample(logits: jax.Array, temperature, top_k, top_p, seed, step, draw_logits: jax.Array | None = None):
    """logits [R, V] fp32 -> (tokens [R], chosen logprob [R], top ids [R, N], top logprobs [R, N]).
    draw_logits: what the draw reads instead (`constrain`'s: logit bias and grammar masks applied).

    Logprobs are of the model's distribution (before logit bias, grammar masks, temperature, top-k
    and top-p), as in vLLM.
    The top-k / top-p search (`filter_logits`) runs only when some row uses top-k or top-p, and the
    draw only when some row samples (lax.cond on flags computed from the arrays, so no recompilation).
    """
    v = logits.shape[-1]
    logprobs = jax.nn.log_softmax(logits, axis=-1)
    drawn_from = logits if draw_logits is None else draw_logits
    greedy = jnp.argmax(drawn_from, axis=-1).astype(jnp.int32)
    sampling = temperature > 0.0

    def draw_all(_):
        scaled = drawn_from / jnp.maximum(temperature, 1e-6)[:, None]
        needs_filter = jnp.any(sampling & ((top_k > 0) | (top_p < 1.0)))
        masked = jax.lax.cond(needs_filter, functools.partial(filter_logits, top_k=jnp.where(sampling, top_k, 0),
                                                              top_p=jnp.where(sampling, top_p, 1.0)),
                              lambda x: x, scaled)

        def draw(s, n, row):
            key = jax.random.fold_in(jax.random.wrap_key_data(s, impl="threefry2x32"), n)
            return jax.random.categorical(key, row)

        return jnp.where(sampling, jax.vmap(draw)(seed, step, masked), greedy).astype(jnp.int32)

    tokens = jax.lax.cond(jnp.any(sampling), draw_all, lambda _: greedy, None)
    chosen = jnp.take_along_axis(logprobs, tokens[:, None], axis=-1)[:, 0]
    top_lp, top_ids = jax.lax.top_k(logprobs, min(MAX_TOP_LOGPROBS, v))
    return tokens, chosen, top_ids.astype(jnp.int32), top_lp
