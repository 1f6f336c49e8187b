"""Sessions of clients that name none, inferred from their prompts' token ids.

An agent's next prompt is its last prompt, the answer it got and what its tools returned, so:
- a call whose prompt strictly extends an earlier call's prompt continues that call's session, if
  that call is still the session's latest;
- a call extending a call that another call already continued forks a new session (the two share a
  prefix, and so their KV, but not a schedule);
- several sessions whose latest calls sent the same prompt (runs that began identically) are told
  apart by their outputs: the call goes to the one whose output its prompt repeats furthest (a
  re-rendered answer rarely equals the generated tokens exactly, since templates serialize tool
  calls their own way, so the output ranks candidates rather than deciding alone), and among equals
  to the oldest;
- anything else starts a session: a first call, a compacted context (a system prompt and a
  summary, which extends no earlier prompt), or the same prompt sent again after it was answered.
A call is kept only once answered, so a retry of a call that failed continues its session.

Tool-call ids decide before the content does: an answer's tool calls carry ids the server made up
(`call_...`), which agents send back with the tool's result. A call that brings back the ids of an
earlier call's tool calls is that call's continuation, even where two runs' prompts and answers are
alike to the token (their ids never are).

Prompts are matched at block granularity. Each call is kept under a hash of its prompt's prefix up
to the last multiple of `block` tokens, with the few tokens past it; a new prompt hashes all its
prefixes at once (a polynomial hash as a numpy cumulative sum) and looks up its block boundaries,
longest first: O(prompt length) a call. A prompt's last `slack` tokens are left out of the match:
text appended to a raw prompt (completions) can tokenize its junction differently, while a chat
template's turns meet at special tokens; the new prompt must still be longer than the earlier one. Keys carry the tenant, so two API keys never share a
session. Memory is bounded: past `max_calls` calls the least recently used are forgotten (a session
whose calls are all forgotten is not continued; its next call starts a new one).
"""
from __future__ import annotations

import collections
import dataclasses
import itertools
import secrets
import threading
from collections.abc import Sequence

import numpy as np

__all__ = ["OUTPUT_KEPT", "Identified", "SessionInference"]

OUTPUT_KEPT = 32  # leading output tokens kept per call, to tell identical prompts' sessions apart
_NONE = np.zeros(0, np.uint64)


@dataclasses.dataclass(eq=False, slots=True)
class _Kept:
    """One call as the index keeps it (token ids as uint64 bytes: a few hundred bytes a call)."""
    session: str
    length: int  # prompt tokens
    key: tuple
    tail: bytes  # the matched prompt's tokens past its last full block
    order: int
    output: np.ndarray = dataclasses.field(default_factory=lambda: _NONE)
    tool_ids: tuple[str, ...] = ()  # the ids of its answer's tool calls


@dataclasses.dataclass(frozen=True)
class Identified:
    """The session a call was put in, and how: "continued" (it extends the session's latest call),
    "forked" (it extends an earlier call of a session that had moved on: a new session) or "new"."""
    session: str
    how: str
    call: _Kept


class SessionInference:
    """Infers the session of each call of one server from its prompt's token ids (module doc)."""

    def __init__(self, max_calls: int = 65_536, block: int = 32, slack: int = 2, alike: int = 64):
        if max_calls < 1 or block < 1 or slack < 0 or alike < 1:
            raise ValueError(f"SessionInference: max_calls ({max_calls}), block ({block}) and alike ({alike}) must "
                             f"be >= 1, slack ({slack}) >= 0")
        self.max_calls, self.block, self.slack, self.alike = max_calls, block, slack, alike
        self._base = np.uint64(secrets.randbits(63) * 2 + 1)  # odd: its powers never vanish mod 2**64
        self._powers = np.ones(1, np.uint64)
        # (tenant, block boundary, hash of the prompt up to it) -> tail length -> tail -> the calls kept
        self._by_key: dict[tuple, dict[int, dict[bytes, list[_Kept]]]] = {}
        self._lru: collections.OrderedDict[_Kept, None] = collections.OrderedDict()
        self._latest: dict[str, _Kept] = {}  # session -> its latest call
        self._by_tool_id: dict[tuple[str, str], _Kept] = {}  # (tenant, tool-call id) -> the call that answered it
        self._order = itertools.count()
        self._prefix = secrets.token_hex(4)
        self._mu = threading.Lock()
        self.forgotten = 0

    def __len__(self) -> int:
        return len(self._lru)

    def _hashes(self, ids: np.ndarray) -> np.ndarray:
        """h[k]: the hash of the first k tokens (h[0] = 0)."""
        n = len(ids)
        if len(self._powers) < n:
            grow = np.full(max(n, 2 * len(self._powers)), self._base, np.uint64)
            grow[0] = 1
            self._powers = np.cumprod(grow)  # wraps mod 2**64, as intended
        with np.errstate(over="ignore"):
            return np.concatenate([np.zeros(1, np.uint64), np.cumsum((ids + np.uint64(1)) * self._powers[:n])])

    def identify(self, tenant: str, prompt: Sequence[int], tool_ids: Sequence[str] = ()) -> Identified:
        """The session of a call with `prompt` from `tenant`; `tool_ids`: the tool-call ids the call
        brings back (its latest assistant turn's). The call is kept once it has been answered
        (`finished`): a call that fails leaves nothing, so its retry continues the same session.

        Raises:
            ValueError: a token id that is not an integer of 64 bits.
        """
        try:
            ids = np.asarray(prompt, dtype=np.int64).astype(np.uint64)
        except (OverflowError, TypeError) as e:
            raise ValueError(f"the prompt's token ids are not 64-bit integers: {e}") from None
        n, b = len(ids), self.block
        with self._mu:
            h = self._hashes(ids)
            found: list[_Kept] = []
            for k in range((max(n - 1, 0) // b) * b, -1, -b):  # kept prompts matched on k..k+b-1 tokens
                bucket = self._by_key.get((tenant, k, int(h[k])))
                if bucket:
                    found = [c for size, tails in bucket.items() if k + size <= n
                             for c in tails.get(ids[k:k + size].tobytes(), ()) if c.length < n]
                    if found:
                        longest = max(c.length for c in found)
                        found = [c for c in found if c.length == longest]
                        break
            parent = next((c for c in (self._by_tool_id.get((tenant, t)) for t in tool_ids)
                           if c is not None and c.length < n), None) or self._pick(found, ids)
            if parent is not None and self._latest.get(parent.session) is parent:
                session, how = parent.session, "continued"
            else:
                session, how = f"~{self._prefix}{next(self._order):x}", "forked" if parent is not None else "new"
            for c in found:
                self._lru.move_to_end(c)
            matched = n - min(self.slack, n // 8)  # (a short prompt is matched whole)
            cut = (matched // b) * b
            call = _Kept(session, n, (tenant, cut, int(h[cut])), ids[cut:matched].tobytes(), next(self._order))
        return Identified(session, how, call)

    def _pick(self, found: list[_Kept], ids: np.ndarray) -> _Kept | None:
        if not found:
            return None
        latest = [c for c in found if self._latest.get(c.session) is c] or found

        def repeated(c: _Kept) -> int:  # how far the prompt repeats the call's output after its own prompt
            rest = ids[c.length:c.length + len(c.output)]
            differ = np.flatnonzero(rest != c.output[:len(rest)])
            return int(differ[0]) if len(differ) else len(rest)
        return max(latest, key=lambda c: (repeated(c), -c.order))

    def finished(self, identified: Identified, output: Sequence[int], tool_ids: Sequence[str] = ()) -> None:
        """The call was answered with `output` (token ids; the leading ones are kept) and tool calls
        with `tool_ids`: it is kept, the latest of its session. Of the calls with one same prompt,
        the `alike` most recent are kept."""
        call = identified.call
        call.output = np.asarray(list(output[:OUTPUT_KEPT]), dtype=np.int64).astype(np.uint64)
        with self._mu:
            if call in self._lru:
                return
            call.tool_ids = tuple(t for t in tool_ids if isinstance(t, str))
            for t in call.tool_ids:
                self._by_tool_id[(call.key[0], t)] = call
            same = self._by_key.setdefault(call.key, {}).setdefault(len(call.tail) // 8, {}).setdefault(call.tail, [])
            same.append(call)
            self._lru[call] = None
            self._latest[call.session] = call
            if len(same) > self.alike:
                self._forget(same[0])
            while len(self._lru) > self.max_calls:
                self._forget(next(iter(self._lru)))

    def _forget(self, call: _Kept) -> None:
        del self._lru[call]
        bucket = self._by_key[call.key]
        tails = bucket[len(call.tail) // 8]
        tails[call.tail].remove(call)
        if not tails[call.tail]:
            del tails[call.tail]
            if not tails:
                del bucket[len(call.tail) // 8]
                if not bucket:
                    del self._by_key[call.key]
        if self._latest.get(call.session) is call:
            del self._latest[call.session]
        for t in call.tool_ids:
            if self._by_tool_id.get((call.key[0], t)) is call:
                del self._by_tool_id[(call.key[0], t)]
        self.forgotten += 1
