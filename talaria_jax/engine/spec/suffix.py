"""Suffix-tree drafts for speculative decoding: no draft model, only the text already seen.

SuffixDecoding (Oliaro et al., 2024; arctic-inference's `SuffixDecodingCache`) drafts from two
trees: a global one over the responses of earlier and in-flight requests (sibling rollouts of one
prompt, a session's earlier calls) and one per request over its own prompt and output. Agents
repeat file contents, diffs and test output, so the last few tokens of a request often occurred
before, and what followed them then is a good guess of what follows now.

`SuffixTree` is a depth-bounded suffix trie: every substring of at most `max_depth` tokens of its
sequences is a path from the root, and each node counts how often its substring occurs. A path that
one occurrence alone reaches is stored as its first node, pointing into the sequence, so text seen
once costs about a node a token (not `max_depth`), and appending a token steps down from the
suffixes seen before only. Nodes of substrings seen more often keep a suffix link (the node of the
substring minus its first token), so the nodes of every suffix of a pattern are found in one walk
plus a chain of links. A draft follows the most frequent children from the node
of a matched suffix while the product of the branch frequencies stays at least `min_token_prob`,
up to `max_spec_factor` x the match length tokens: a chain (one child per step) or a tree (the most
likely nodes first, each child scored by its path's probability).

`SuffixDrafter` keeps the trees of one engine: one global tree per tenant (a request's
`cache_salt`: no tenant drafts from another's text), with bounded memory (the oldest finished
responses are evicted first), and a tree per request. `draft()` drafts a whole batch in one call.

The drafter runs on a compiled backend where the package was built with it (`_suffix_native.cpp`, a C++
extension built on install): the same trees and scans, the same drafts bit for bit, a step's batch
extended and drafted in one call each. `SuffixDrafter(cfg, backend=...)` picks it: "auto" (the default:
native where it imports), "native" or "python" (the classes here, which are its reference).
"""
from __future__ import annotations

import collections
import dataclasses
import heapq
import itertools
import math
import sys
from collections.abc import Sequence

import numpy as np

MAX_DRAFT_TOKENS = 31  # the verifier's ancestor mask is one int32 bit per draft token (plus the root)

BACKENDS = ("auto", "native", "python")


def _native_backend():
    """The compiled backend (built on install where a C++ compiler is found) with its scores added as this
    Python's sum() adds floats (3.12 compensates rounding), else None; and why not."""
    try:
        import talaria_jax.engine.spec._suffix_native as ext
        rng = np.random.default_rng(0)
        samples = [(rng.random(n) * 0.7 ** np.arange(n)).tolist() for n in (3, 9, 16, 31, 31, 31)]
        for compensated in (sys.version_info >= (3, 12), sys.version_info < (3, 12)):
            ext.set_compensated_sum(compensated)
            if all(ext.sum_floats(xs) == sum(xs) for xs in samples):
                return ext, ""
    except Exception as e:  # pragma: no cover (an install without a compiler, or a stale build)
        return None, f"{type(e).__name__}: {e}"
    return None, "its float sums differ from this Python's sum()"  # pragma: no cover


native, NATIVE_ERROR = _native_backend()


@dataclasses.dataclass(frozen=True)
class SpecConfig:
    """Speculative decoding with suffix drafts (arctic-inference's names where they mean the same).

    max_spec_tokens: draft tokens per request and step (at most 31). max_spec_factor and
    max_spec_offset: a match of m tokens drafts at most max_spec_factor x m + max_spec_offset tokens.
    min_token_prob: a draft token's path probability (the product of its branch frequencies) must
    reach this. tree: tree drafts (several continuations per position) instead of chains.
    max_depth: the longest substring the trees index (and the longest match). max_cached_tokens:
    the global trees' bound; the oldest finished responses are evicted past it. max_prompt_tokens:
    a request's own text holds at most this many of its prompt's last tokens. policy: "auto" drafts
    as many tokens per step as the measured step-cost curve makes worth verifying at the batch size
    (engine/spec/policy.py), "always" max_spec_tokens at any batch size."""
    max_spec_tokens: int = 16
    max_spec_factor: float = 1.0
    max_spec_offset: float = 0.0
    min_token_prob: float = 0.1
    tree: bool = False
    max_depth: int = 64
    max_cached_tokens: int = 1 << 20
    max_prompt_tokens: int = 1 << 17
    policy: str = "auto"

    def validate(self) -> None:
        if self.policy not in ("auto", "always"):
            raise ValueError(f"SpecConfig.policy must be 'auto' or 'always', got {self.policy!r}")
        if not 1 <= self.max_spec_tokens <= MAX_DRAFT_TOKENS:
            raise ValueError(f"SpecConfig.max_spec_tokens must be in [1, {MAX_DRAFT_TOKENS}], "
                             f"got {self.max_spec_tokens}")
        for f in ("max_depth", "max_cached_tokens", "max_prompt_tokens"):
            if getattr(self, f) < 1:
                raise ValueError(f"SpecConfig.{f} must be >= 1, got {getattr(self, f)}")
        if not 0 < self.max_spec_factor < math.inf:
            raise ValueError(f"SpecConfig.max_spec_factor must be > 0 and finite, got {self.max_spec_factor}")
        if not math.isfinite(self.max_spec_offset):
            raise ValueError(f"SpecConfig.max_spec_offset must be finite, got {self.max_spec_offset}")
        if not 0.0 <= self.min_token_prob <= 1.0:
            raise ValueError(f"SpecConfig.min_token_prob must be in [0, 1], got {self.min_token_prob}")


@dataclasses.dataclass
class Draft:
    """Draft tokens in depth-first order, the most likely child first, so a chain's nodes (and a tree's
    most likely path) are 0, 1, 2, ...: parents[i] is the index of token i's parent (-1: the request's
    last token), probs[i] its path probability. score = sum(probs), the expected accepted tokens."""
    tokens: np.ndarray   # i32 [n]
    parents: np.ndarray  # i32 [n]
    probs: np.ndarray    # f32 [n]
    score: float = 0.0
    match_len: int = 0

    def __len__(self) -> int:
        return len(self.tokens)

    def first(self, n: int) -> "Draft":
        """The first n nodes (still a tree: a parent comes before its children)."""
        n = max(n, 0)
        return Draft(self.tokens[:n], self.parents[:n], self.probs[:n], float(self.probs[:n].sum()), self.match_len)

    @classmethod
    def empty(cls) -> "Draft":
        return cls(_NO_TOKENS, _NO_TOKENS, _NO_PROBS)


_NO_TOKENS, _NO_PROBS = np.zeros(0, np.int32), np.zeros(0, np.float32)
_NO_TOKENS.flags.writeable = _NO_PROBS.flags.writeable = False


class SuffixTree:
    """A depth-bounded suffix trie with counts over several token sequences, its single-occurrence
    paths left implicit.

    Every substring of at most `max_depth` tokens of the sequences is a node with its count of
    occurrences. A substring that occurs once has one occurrence, and so has everything below it:
    its node and its descendants are that occurrence's next tokens. The trie stores such a path's
    first node only, a *leaf* that points at its occurrence (sequence, start), and reads the rest from
    the sequence; the nodes of substrings seen more than once are *inner*, with their children and
    suffix links. A node is an int (a leaf or inner node) or, below a leaf, a tuple (tokens, end,
    depth): the substring tokens[end - depth + 1:end + 1].

    Appending a token steps down from the inner nodes of the sequence's suffixes (`_live`: the
    suffixes seen before too, a handful in most text rather than `max_depth`); the first suffix that
    is new, and every longer one, becomes a leaf; a leaf reached by a second occurrence turns inner,
    and its occurrence's next token becomes a leaf below it (when that occurrence is the end of a
    sequence so far, that sequence's next token steps down from it). Nodes are ints in flat lists
    (count, depth, suffix link, first child, next sibling, token, a leaf's sequence and start), so a
    trie of millions of nodes holds no Python objects the garbage collector walks."""

    def __init__(self, max_depth: int = 64):
        self.max_depth = max_depth
        self.root = 0
        self._child: dict[int, int] = {}  # node << 32 | token -> child
        self._count, self._depth, self._link = [0], [0], [0]
        self._first, self._next, self._token = [-1], [-1], [-1]  # children as a linked list, for drafting
        self._seq: list = [None]  # a leaf's sequence id (None: an inner node)
        self._start = [0]  # a leaf's occurrence: where its substring starts in that sequence
        self._free: list[int] = []  # ids of removed nodes, reused first
        self._tokens: dict[object, list[int]] = {}
        self._live: dict[object, list[int]] = {}  # per sequence: inner nodes of its suffixes < max_depth, shortest first
        self._top: dict[object, int | None] = {}  # per sequence: the inner node of its suffix of max_depth tokens
        self.num_nodes = 1
        self.num_tokens = 0
        self.ops = _TrieOps(self)

    def __contains__(self, seq_id) -> bool:
        return seq_id in self._tokens

    def depth(self, node) -> int:
        """The length of the node's substring."""
        return node[2] if type(node) is tuple else self._depth[node]

    def _leaf(self, parent: int, t: int, seq_id, start: int) -> None:
        """A new leaf below parent for token t: the occurrence of seq_id starting at start."""
        if self._free:
            x = self._free.pop()
            self._count[x], self._depth[x], self._link[x], self._token[x] = 1, self._depth[parent] + 1, -1, t
            self._first[x], self._next[x], self._seq[x], self._start[x] = -1, self._first[parent], seq_id, start
        else:
            x = len(self._count)
            self._count.append(1)
            self._depth.append(self._depth[parent] + 1)
            self._link.append(-1)
            self._first.append(-1)
            self._next.append(self._first[parent])
            self._token.append(t)
            self._seq.append(seq_id)
            self._start.append(start)
        self._first[parent] = self._child[parent << 32 | t] = x
        self.num_nodes += 1

    def _grow(self, x: int, link: int) -> None:
        """Leaf x, reached by a second occurrence, turns inner (suffix link: link); its occurrence's
        next token becomes a leaf below it, or, at the end of its sequence so far, the sequence's
        next token steps down from x."""
        seq_id, start, d = self._seq[x], self._start[x], self._depth[x]
        self._seq[x], self._link[x] = None, link
        toks = self._tokens[seq_id]
        if start + d < len(toks):
            if d < self.max_depth:
                self._leaf(x, toks[start + d], seq_id, start)
        elif d < self.max_depth:
            self._live[seq_id].append(x)  # its suffixes shorter than d are inner already (stepped first)
        else:
            self._top[seq_id] = x

    def extend(self, seq_id, tokens: Sequence[int]) -> None:
        """Appends tokens to sequence seq_id (a new one if unknown): each suffix ending at a new token
        is counted once more."""
        toks = self._tokens.setdefault(seq_id, [])
        live = self._live.setdefault(seq_id, [0])  # shortest first: live[d] is the suffix of d tokens
        get, count, depth, seq, cap = self._child.get, self._count, self._depth, self._seq, self.max_depth
        top = self._top.get(seq_id)
        for t in tokens:
            t = int(t)
            toks.append(t)
            end = len(toks) - 1
            count[0] += 1
            nxt, below, top = [0], 0, None
            for d, node in enumerate(live):  # shortest first, so a leaf turning inner finds its suffix link
                child = get(node << 32 | t)
                if child is None:  # a new substring, and so is each longer suffix: leaves
                    for node in live[d:]:
                        self._leaf(node, t, seq_id, end - depth[node])
                    break
                count[child] += 1
                if seq[child] is not None:
                    self._grow(child, below)
                below = child
                if depth[child] < cap:
                    nxt.append(child)
                else:
                    top = child
            live = nxt
        self._live[seq_id] = live
        self._top[seq_id] = top
        self.num_tokens += len(tokens)

    def remove(self, seq_id) -> None:
        """Forgets a sequence: its suffixes' counts go down, and nodes no sequence reaches are freed."""
        toks = self._tokens.pop(seq_id, None)
        self._live.pop(seq_id, None)
        self._top.pop(seq_id, None)
        if toks is None:
            return
        count = self._count
        count[0] -= len(toks)
        self.num_tokens -= len(toks)
        for i in range(len(toks)):
            node = 0
            for t in toks[i:i + self.max_depth]:  # down to its leaf (count 1: dropped) or its end
                child = self._child[node << 32 | t]
                count[child] -= 1
                if count[child] == 0:  # nothing below it is reached either: drop the subtree
                    self._drop(node, child)
                    break
                node = child

    def _drop(self, parent: int, node: int) -> None:
        first, nxt = self._first, self._next
        if first[parent] == node:  # unlink it from its parent's children
            first[parent] = nxt[node]
        else:
            x = first[parent]
            while nxt[x] != node:
                x = nxt[x]
            nxt[x] = nxt[node]
        stack = [(parent, node)]
        while stack:
            p, x = stack.pop()
            del self._child[p << 32 | self._token[x]]
            self._seq[x] = None
            self._free.append(x)
            self.num_nodes -= 1
            c = first[x]
            while c != -1:
                stack.append((x, c))
                c = nxt[c]

    def _find(self, tokens: list[int]):
        """The node of substring tokens, or None where it does not occur."""
        get, seq, node = self._child.get, self._seq, 0
        for j, t in enumerate(tokens):
            node = get(node << 32 | t)
            if node is None:
                return None
            if seq[node] is not None:  # a leaf: the rest is its occurrence's next tokens
                toks, start, d = self._tokens[seq[node]], self._start[node], self._depth[node]
                rest = tokens[j + 1:]
                if d + len(rest) > self.max_depth or toks[start + d:start + d + len(rest)] != rest:
                    return None
                return toks, start + d + len(rest) - 1, d + len(rest)
        return node

    def _longest_inner(self, pattern: list[int]) -> int:
        """The inner node of the pattern's longest suffix that has one (inner substrings are closed
        under taking prefixes and suffixes, so the search is that of a trie holding only them)."""
        get, depth, seq, link, cap = self._child.get, self._depth, self._seq, self._link, self.max_depth
        # It is mostly short: try the suffixes of up to 8 tokens, each from the root, shortest first.
        p, node, short = len(pattern), 0, min(len(pattern), 8, cap - 1)
        for k in range(1, short + 1):
            x = 0
            for t in pattern[p - k:]:
                x = get(x << 32 | t)
                if x is None or seq[x] is not None:
                    return node
            node = x
        if short == p:
            return node
        # Else walk from the left, restarting via suffix links on a miss (Aho-Corasick style).
        node = 0
        for t in pattern:
            while True:
                x = get(node << 32 | t) if depth[node] < cap else None
                if x is not None and seq[x] is None:
                    node = x
                    break
                if not node:
                    break
                node = link[node]
        return node

    def match(self, pattern: Sequence[int]) -> list:
        """Nodes of the pattern's suffixes that occur, longest first (`depth(node)` is the match length)."""
        pattern = list(pattern[-self.max_depth:])
        node = self._longest_inner(pattern)
        out, k = self._links(node), self._depth[node]
        at = self._find(pattern[len(pattern) - k - 1:]) if k < len(pattern) else None
        if type(at) is tuple:  # the suffix one longer occurs once: so do the longer ones that occur, there
            toks, end, k = at
            lo = k
            while k < len(pattern) and end - k >= 0 and toks[end - k] == pattern[-k - 1]:
                k += 1
            out = [(toks, end, j) for j in range(k, lo - 1, -1)] + out
        return out

    def _links(self, node: int) -> list[int]:
        """Inner node `node` and the nodes of its suffixes, longest first (the root left out)."""
        out, link = [], self._link
        while node:
            out.append(node)
            node = link[node]
        return out

    def match_own(self, seq_id, pattern: Sequence[int]) -> list:
        """match(pattern) without walking the pattern when it ends with sequence seq_id's last
        r = min(len, max_depth) tokens (a request's context and its response in the global tree),
        unless the pattern's suffix of r + 1 tokens (one token from before the sequence) occurs too.
        Its suffixes that occur elsewhere are the sequence's inner ones; the longer ones occur only
        here, at the end, with no next token, and are left out: they draft nothing."""
        toks, pattern = self._tokens.get(seq_id, ()), list(pattern[-self.max_depth:])
        r = min(len(toks), self.max_depth)
        if not 0 < r <= len(pattern) or pattern[len(pattern) - r:] != toks[-r:]:  # not its end
            return self.match(pattern)
        if r < len(pattern) and self._find(pattern[len(pattern) - r - 1:]) is not None:
            return self.match(pattern)
        top = self._top.get(seq_id)
        return ([top] if top is not None else []) + self._live[seq_id][:0:-1]

    def draft(self, pattern: Sequence[int], max_tokens: int, cfg: SpecConfig, seq_id=None,
              floor: float = 0.0) -> Draft:
        """The best draft after pattern scoring above floor, else an empty one (seq_id: a sequence the
        pattern likely ends with, see match_own)."""
        nodes = self.match(pattern) if seq_id is None else self.match_own(seq_id, pattern)
        depth, count = self._depth, self._count
        return best_draft([(depth[n], count[n], n) if type(n) is int else (n[2], 1, n) for n in nodes], self.ops,
                           max_tokens, cfg, self.max_depth, floor)


class _TrieOps:
    """Counts and children of a trie's nodes (the draft functions' view of a node)."""
    def __init__(self, tree: SuffixTree):
        self.tree = tree

    def _below(self, node) -> tuple[list[int], int, int] | None:
        """A leaf or a node below one as (tokens, end, depth); None for an inner node."""
        if type(node) is tuple:
            return node
        tr = self.tree
        s = tr._seq[node]
        return None if s is None else (tr._tokens[s], tr._start[node] + tr._depth[node] - 1, tr._depth[node])

    def count(self, node) -> int:
        return 1 if type(node) is tuple else self.tree._count[node]

    def children(self, node, min_count: float = 0) -> list[tuple[int, int, object]]:
        """(token, count, child) of the children occurring at least min_count times."""
        tr, at = self.tree, self._below(node)
        if at is not None:
            toks, end, d = at
            going = d < tr.max_depth and end + 1 < len(toks) and min_count <= 1
            return [(toks[end + 1], 1, (toks, end + 1, d + 1))] if going else []
        out, count, c = [], tr._count, tr._first[node]
        while c != -1:
            if count[c] >= min_count:
                out.append((tr._token[c], count[c], c))
            c = tr._next[c]
        return out

    def going_on(self, node) -> int:
        """How many of the node's occurrences have a next token (an upper bound where that is slow)."""
        tr, at = self.tree, self._below(node)
        if at is not None:
            toks, end, d = at
            return int(d < tr.max_depth and end + 1 < len(toks))
        total, n, c = 0, 0, tr._first[node]
        while c != -1:
            n += 1
            if n > 8:
                return tr._count[node]
            total += tr._count[c]
            c = tr._next[c]
        return total

    def best_child(self, node) -> tuple[int, int, object] | None:
        """The most frequent child (ties: the smaller token), or None."""
        kids = self.children(node)
        return max(kids, key=lambda k: (k[1], -k[0])) if kids else None

    def run(self, node, n: int, p: float, min_prob: float, above: float = -1.0):
        """The steps below node (at most n) while each has one child only, so its path probability is
        p x child count / node's count: tokens, path probabilities (each >= min_prob and > above) and
        the last node. A chain of such steps (one child per inner node, a leaf's occurrence) is taken
        at once."""
        tr = self.tree
        count, first, nxt, token, seq = tr._count, tr._first, tr._next, tr._token, tr._seq
        toks, probs = [], []
        c0 = self.count(node)
        while type(node) is int and seq[node] is None:  # inner
            child = first[node]
            if len(toks) >= n or child == -1 or nxt[child] != -1:
                return toks, probs, node
            q = p * count[child] / c0
            if q < min_prob or q <= above:
                return toks, probs, node
            toks.append(token[child])
            probs.append(q)
            node = child
        text, end, d = self._below(node)  # one occurrence: its next tokens, each as likely
        q = p * 1 / c0
        m = min(n - len(toks), tr.max_depth - d, len(text) - end - 1)
        if m <= 0 or q < min_prob or q <= above:
            return toks, probs, node
        return toks + text[end + 1:end + 1 + m], probs + [q] * m, (text, end + m, d + m)


class _ScanOps:
    """The same view of a `TokenScan` match: a node is the sorted list of positions where the matched
    substring ends; a child narrows it to the occurrences followed by one token. (Drafting walks few
    occurrences a few steps: plain lists beat numpy's per-call cost there.)"""
    def __init__(self, text: list[int]):
        self.text, self.n = text, len(text)

    @staticmethod
    def count(ends: list[int]) -> int:
        return len(ends)

    def going_on(self, ends: list[int]) -> int:
        return len(ends) - (ends[-1] == self.n - 1)  # only the last can be the text's end

    def children(self, ends: list[int], min_count: float = 0) -> list[tuple[int, int, list[int]]]:
        text, groups = self.text, {}
        for e in ends[:-1] if ends[-1] == self.n - 1 else ends:
            groups.setdefault(text[e + 1], []).append(e + 1)
        return [(t, len(g), g) for t, g in groups.items() if len(g) >= min_count]

    def best_child(self, ends: list[int]) -> tuple[int, int, list[int]] | None:
        kids = self.children(ends)
        return max(kids, key=lambda k: (k[1], -k[0])) if kids else None  # ties: the smaller token

    def run(self, ends: list[int], n: int, p: float, min_prob: float, above: float = -1.0):
        """As _TrieOps.run: the steps where every occurrence still in the text goes on with the same
        token (one at the text's end drops out: the count shrinks)."""
        text, k0, toks, probs = self.text, len(ends), [], []
        if k0 == 1:
            if p < min_prob or p <= above:
                return toks, probs, ends
            toks = text[ends[0] + 1:ends[0] + 1 + n]
            return toks, [p] * len(toks), [ends[0] + len(toks)]
        while len(toks) < n:
            nxt = [e + 1 for e in (ends[:-1] if ends[-1] == self.n - 1 else ends)]
            if not nxt:
                break
            t = text[nxt[0]]
            q = p * len(nxt) / k0
            if q < min_prob or q <= above or any(text[e] != t for e in nxt):
                break
            toks.append(t)
            probs.append(q)
            ends = nxt
        return toks, probs, ends



class TokenScan:
    """A request's own text (prompt and output) as a flat array, matched by scanning: the drafts a trie
    over it would give, without building one (a trie over a prompt costs 1-2 ms per thousand tokens
    in Python, 20x what copying it here does, and a scan of 100K tokens is one vectorised compare)."""

    def __init__(self, tokens: Sequence[int], max_depth: int = 64):
        self.max_depth = max_depth
        # The text starts after max_depth -1s (no token), so looking back from any position stays in
        # the buffer and finds no match there.
        self._buf = np.full(max_depth + max(16, 2 * len(tokens)), -1, np.int32)
        self._n = 0
        self._list: list[int] = []  # the text again, for drafting
        self._back = np.arange(max_depth)
        self.extend(tokens)

    @property
    def text(self) -> np.ndarray:
        return self._buf[self.max_depth:self.max_depth + self._n]

    def extend(self, tokens: Sequence[int]) -> None:
        k, start = len(tokens), self.max_depth + self._n
        if start + k > len(self._buf):
            self._buf = np.concatenate([self._buf, np.zeros(max(start + k, len(self._buf)), np.int32)])
        self._buf[start:start + k] = tokens
        self._list.extend(self._buf[start:start + k].tolist())
        self._n += k

    def match(self, pattern: Sequence[int]) -> list[tuple[int, np.ndarray]]:
        """(match length m, end positions of the occurrences of the pattern's last m tokens, sorted),
        longest first, for each m where the occurrences change (for the m between, they are those of
        the next longer m, which drafts the same but may draft more tokens); as in a trie, an
        occurrence at the text's end counts (with no continuation), and a match that occurs only there
        is left out."""
        return [(m, np.asarray(ends)) for m, _, ends in self._levels(pattern)]

    def _levels(self, pattern: Sequence[int]):
        """match(), lazily: the shorter levels are only built if the drafting gets to them."""
        n, buf, pad, pattern = self._n, self._buf, self.max_depth, list(pattern[-self.max_depth:])
        p = len(pattern)
        if not p or not n:
            return
        ends, m = np.flatnonzero(buf[pad:pad + n] == pattern[-1]), 1  # the occurrences of the last m tokens
        shorter = []  # shorter[v - 1]: the occurrences of the last v tokens, for v < m
        if len(ends) > 16:  # many occurrences: narrow them one token at a time
            rev = np.asarray(pattern[::-1], np.int32)  # rev[j]: j tokens back
            while len(ends) > 16 and m < p:
                shorter.append(ends)
                ends, m = ends[buf[ends + (pad - m)] == rev[m]], m + 1
        last = -1
        if len(ends):  # a few left: the match length of each
            text, ends, lens = self._list, ends.tolist(), []
            for e in ends:
                # the text's own end (ends are sorted) matches no longer than any other match
                most = min(p, max(lens, default=0)) if e == n - 1 else p
                v = min(m, most)
                while v < most and v <= e and text[e - v] == pattern[p - 1 - v]:
                    v += 1
                lens.append(v)
            for v in sorted(set(lens), reverse=True):
                if v:
                    level = [e for e, l in zip(ends, lens) if l >= v]
                    last = len(level)
                    yield v, last, level
        for v in range(m - 1, 0, -1):
            if len(shorter[v - 1]) != last:
                last = len(shorter[v - 1])
                yield v, last, shorter[v - 1].tolist()

    def draft(self, pattern: Sequence[int], max_tokens: int, cfg: SpecConfig, floor: float = 0.0) -> Draft:
        """The best draft after pattern scoring above floor, else an empty one."""
        return best_draft(self._levels(pattern), _ScanOps(self._list), max_tokens, cfg, None, floor)


def best_draft(matches, ops, max_tokens: int, cfg: SpecConfig, max_depth: int | None = None,
               floor: float = 0.0) -> Draft:
    """The best-scoring draft over the matched suffixes (longest first; on equal scores the longer match,
    as arctic-inference). A shorter match that occurs no more often continues exactly like the longer
    one but may draft fewer tokens, so it is skipped, unless the longer one's draft may have been cut
    by the trie's depth (a node at depth d has descendants down to max_depth only: the shorter match
    has more room). No draft of a match scores more than its token limit x the share of its
    occurrences that go on (each token's path probability is at most that): a match whose bound is
    not above the best score so far is skipped, and once the limit alone is not, the search stops
    (every shorter match has a lower limit). Only drafts scoring above floor count (else: empty).
    `matches`: (depth, count, node) of each matched suffix, longest first; `ops`: the counts and children
    of those nodes (count, going_on, children, best_child, run: a trie's `_TrieOps`, a scan's `_ScanOps`,
    or any other view of the same counts)."""
    best, score, last_count, last_room = Draft.empty(), floor, -1, True
    factor, offset = cfg.max_spec_factor, cfg.max_spec_offset + 1e-6
    draft = _tree_draft if cfg.tree else _chain_draft
    for depth, count, node in matches:  # count: ops.count(node)
        if count == last_count and last_room:
            continue
        limit = min(max_tokens, int(depth * factor + offset))
        if limit <= score:
            break
        last_count, last_room = count, max_depth is None or depth + limit <= max_depth
        if limit * ops.going_on(node) <= score * count:
            continue
        d = draft(ops, node, limit, cfg.min_token_prob)
        d.match_len = depth
        if d.score > score:
            best, score = d, d.score
    return best


def _chain_draft(ops, node, limit: int, min_prob: float) -> Draft:
    toks, probs, p = [], [], 1.0
    while len(toks) < limit:
        run_toks, run_probs, node = ops.run(node, limit - len(toks), p, min_prob)  # one-child steps at once
        toks += run_toks
        probs += run_probs
        p = probs[-1] if run_probs else p
        if len(toks) >= limit:
            break
        kid = ops.best_child(node)
        if kid is None:
            break
        tok, count, child = kid
        p *= count / ops.count(node)
        if p < min_prob:
            break
        toks.append(tok)
        probs.append(p)
        node = child
    n = len(toks)
    return Draft(np.asarray(toks, np.int32), np.arange(-1, n - 1, dtype=np.int32), np.asarray(probs, np.float32),
                 float(sum(probs)))


def _tree_draft(ops, node, limit: int, min_prob: float) -> Draft:
    """The `limit` most likely nodes below `node` (path probability >= min_prob): best-first, so every
    chosen node's parent is chosen too. Returned in depth-first order, most likely child first."""
    tie = itertools.count()
    heap = [(-1.0, next(tie), None, None, node)]  # (-path prob, key, parent key, token, node)
    chosen: list[tuple[float, object, int, int]] = []
    while heap and len(chosen) < limit + 1:
        negp, key, parent, tok, n = heapq.heappop(heap)
        chosen.append((-negp, parent, tok, key))
        # n's one-child steps more likely than anything in the heap would be popped next, one by one:
        # take them at once.
        run_toks, run_probs, n = ops.run(n, limit + 1 - len(chosen), -negp, min_prob, -heap[0][0] if heap else -1.0)
        for t, q in zip(run_toks, run_probs):
            k = next(tie)
            chosen.append((q, key, t, k))
            key = k
        if len(chosen) >= limit + 1:
            break
        negp = -run_probs[-1] if run_probs else negp
        total = ops.count(n)
        min_count = min_prob * total / -negp * (1 - 1e-9)  # (a margin for rounding: p is checked below)
        for t, c, child in sorted(ops.children(n, min_count), key=lambda k: (-k[1], k[0])):  # ties: smaller token
            p = -negp * c / total
            if p >= min_prob:
                heapq.heappush(heap, (-p, next(tie), key, t, child))
    above = [parent for _, parent, _, _ in chosen[1:]]  # chosen[0] is the matched node itself
    if len(set(above)) == len(above):  # no node with two children: one path, in the order chosen
        n = len(above)
        probs = [p for p, _, _, _ in chosen[1:]]
        return Draft(np.asarray([tok for _, _, tok, _ in chosen[1:]], np.int32), np.arange(-1, n - 1, dtype=np.int32),
                     np.asarray(probs, np.float32), float(sum(probs)))
    kids = collections.defaultdict(list)
    for p, parent, tok, key in chosen[1:]:
        kids[parent].append((p, tok, key))
    toks, parents, probs = [], [], []
    stack = [(-1, k) for k in sorted(kids[chosen[0][3]])]  # ascending: pop() takes the most likely first
    while stack:
        parent_idx, (p, tok, key) = stack.pop()
        idx = len(toks)
        toks.append(tok)
        parents.append(parent_idx)
        probs.append(p)
        below = kids.get(key)
        if below:
            stack.extend((idx, k) for k in (sorted(below) if len(below) > 1 else below))
    return Draft(np.asarray(toks, np.int32), np.asarray(parents, np.int32), np.asarray(probs, np.float32),
                 float(sum(probs)))


class SuffixDrafter:
    """The suffix trees of one engine: global trees per tenant over responses, one tree per request over
    its prompt and output. Call `start` when a request arrives, `extend` with each new output token,
    `finish` when it ends, and `draft` for a batch before each step."""

    def __new__(cls, cfg: SpecConfig = SpecConfig(), backend: str = "auto"):
        if cls is SuffixDrafter:
            if backend not in BACKENDS:
                raise ValueError(f"SuffixDrafter backend must be one of {BACKENDS}, got {backend!r}")
            if backend == "native" and native is None:
                raise ImportError(f"the compiled suffix drafter is not built: {NATIVE_ERROR}")
            if backend != "python" and native is not None:
                cls = NativeSuffixDrafter
        return super().__new__(cls)

    def __getnewargs__(self):  # a copy or unpickled drafter keeps its backend
        return self.cfg, self.backend

    def __init__(self, cfg: SpecConfig = SpecConfig(), backend: str = "auto"):
        """backend: "native" (the compiled one), "python" (this class), "auto" (native where built)."""
        cfg.validate()
        self.cfg = cfg
        self.backend = "python"
        self.global_trees: dict[object, SuffixTree] = {}
        self._requests: dict[str, tuple[object, TokenScan, list[int]]] = {}  # id -> tenant, own text, last tokens
        self._finished: collections.OrderedDict[tuple[object, str], int] = collections.OrderedDict()

    def start(self, request_id: str, prompt: Sequence[int], tenant=None) -> None:
        tree = TokenScan(prompt[-self.cfg.max_prompt_tokens:], self.cfg.max_depth)
        self.global_trees.setdefault(tenant, SuffixTree(self.cfg.max_depth))
        self._requests[request_id] = (tenant, tree, list(prompt[-self.cfg.max_depth:]))

    def extend(self, request_id: str, tokens: Sequence[int]) -> None:
        """New output tokens of an in-flight request: into its own tree and its tenant's global tree (so
        its siblings draft from it while it runs)."""
        tenant, tree, tail = self._requests[request_id]
        tree.extend(tokens)
        self.global_trees[tenant].extend(request_id, tokens)
        tail.extend(tokens)
        del tail[:-self.cfg.max_depth]

    def extend_batch(self, request_ids: Sequence[str], tokens: Sequence[int]) -> None:
        """One new output token for each request: `extend(rid, (tok,))` for each (the native backend
        takes the batch in one call)."""
        for rid, tok in zip(request_ids, tokens):
            self.extend(rid, (tok,))

    def finish(self, request_id: str) -> None:
        """The request's own tree goes; its response stays in the global tree until evicted."""
        entry = self._requests.pop(request_id, None)
        if entry is None:
            return
        tenant = entry[0]
        g = self.global_trees[tenant]
        if request_id in g:
            self._finished[(tenant, request_id)] = None
        while self._finished and self.num_cached_tokens() > self.cfg.max_cached_tokens:
            (old_tenant, old_id), _ = self._finished.popitem(last=False)
            self.global_trees[old_tenant].remove(old_id)

    def __contains__(self, request_id: str) -> bool:
        return request_id in self._requests

    def num_cached_tokens(self) -> int:
        return sum(t.num_tokens for t in self.global_trees.values())

    def draft(self, request_ids: Sequence[str], max_tokens: Sequence[int] | int | None = None) -> list[Draft]:
        """One draft per request (empty when nothing matches), the better-scoring of its own tree's and
        its tenant's global tree's; max_tokens caps each (default and ceiling: cfg.max_spec_tokens)."""
        cap = self.cfg.max_spec_tokens
        if max_tokens is None or isinstance(max_tokens, int):
            max_tokens = [cap if max_tokens is None else max_tokens] * len(request_ids)
        out = []
        for rid, limit in zip(request_ids, max_tokens):
            limit = min(int(limit), cap)
            if limit < 1:
                out.append(Draft.empty())
                continue
            tenant, tree, tail = self._requests[rid]
            glob = self.global_trees[tenant].draft(tail, limit, self.cfg, rid)
            # The own text's draft is taken unless the global one scores more: it only has to tie.
            own = tree.draft(tail, limit, self.cfg, floor=glob.score - 1e-9 if glob.score else 0.0)
            out.append(glob if glob.score > own.score else own)
        return out


class NativeSuffixDrafter(SuffixDrafter):
    """SuffixDrafter on the compiled backend (what `SuffixDrafter(cfg)` makes where it is built): the same
    calls and drafts. Each (tenant, request id) whose text the trees hold has a slot, the sequence's id
    in the native trees; `global_trees` maps tenants to views of their trees (`in`, `num_tokens`)."""

    def __init__(self, cfg: SpecConfig = SpecConfig(), backend: str = "native"):
        super().__init__(cfg, backend)
        self.backend = "native"
        self.global_trees: dict[object, _NativeTree] = {}
        self._requests: dict[str, tuple[object, int]] = {}  # id -> tenant, slot
        self._slots: dict[tuple[object, str], int] = {}
        self._new_slot = itertools.count()
        self._native = native.Drafter(cfg.max_spec_tokens, cfg.max_spec_factor, cfg.max_spec_offset,
                                      cfg.min_token_prob, cfg.tree, cfg.max_depth, cfg.max_cached_tokens,
                                      cfg.max_prompt_tokens)

    def __reduce__(self):
        raise TypeError("a compiled suffix drafter cannot be copied or pickled (its trees live in C++); "
                        "use SuffixDrafter(cfg, backend='python')")

    def start(self, request_id: str, prompt: Sequence[int], tenant=None) -> None:
        tree = self.global_trees.get(tenant)
        if tree is None:
            tree = self.global_trees[tenant] = _NativeTree(self, tenant, self._native.add_tenant())
        old = self._requests.get(request_id)
        if old is not None and old[0] != tenant:  # restarted under another tenant: its old own text goes
            self._native.end(old[1])
        slot = self._slots.get((tenant, request_id))
        if slot is None:
            slot = self._slots[(tenant, request_id)] = next(self._new_slot)
        self._native.start(slot, tree.index, prompt)
        self._requests[request_id] = (tenant, slot)

    def extend(self, request_id: str, tokens: Sequence[int]) -> None:
        self._native.extend(self._requests[request_id][1], tokens)

    def extend_batch(self, request_ids: Sequence[str], tokens: Sequence[int]) -> None:
        req = self._requests
        self._native.extend_batch(np.fromiter((req[r][1] for r in request_ids), np.int64, len(request_ids)),
                                  np.asarray(tokens, np.int32))

    def finish(self, request_id: str) -> None:
        entry = self._requests.get(request_id)
        if entry is not None:
            self._native.end(entry[1])
        super().finish(request_id)
        if entry is not None and request_id not in self.global_trees[entry[0]]:
            self._slots.pop((entry[0], request_id), None)

    def num_cached_tokens(self) -> int:
        return self._native.num_tokens()

    def draft(self, request_ids: Sequence[str], max_tokens: Sequence[int] | int | None = None) -> list[Draft]:
        cap, n = self.cfg.max_spec_tokens, len(request_ids)
        if max_tokens is None or isinstance(max_tokens, int):
            limits = np.full(n, cap if max_tokens is None else max_tokens, np.int64)
        else:
            limits = np.asarray(max_tokens, np.int64)
            n = min(n, len(limits))
            limits = limits[:n]
        req, none = self._requests, (None, -1)
        slots = np.fromiter((req.get(r, none)[1] for r in request_ids[:n]), np.int64, n)
        try:
            toks, parents, probs, offsets, scores, match_len = self._native.draft(slots, limits)
        except KeyError:
            for r, limit in zip(request_ids, limits.tolist()):
                if min(limit, cap) >= 1:
                    req[r]  # the request that is not known: its KeyError
            raise
        offsets, scores, match_len = offsets.tolist(), scores.tolist(), match_len.tolist()
        empty, out = Draft.empty, []
        for i in range(n):
            a, b = offsets[i], offsets[i + 1]
            out.append(Draft(toks[a:b], parents[a:b], probs[a:b], scores[i], match_len[i]) if b > a else empty())
        return out


class _NativeTree:
    """A tenant's global tree in a NativeSuffixDrafter, as far as the drafter's users see a SuffixTree:
    `seq_id in tree`, `num_tokens`, `remove(seq_id)`."""

    def __init__(self, drafter: NativeSuffixDrafter, tenant, index: int):
        self.drafter, self.tenant, self.index = drafter, tenant, index

    def __contains__(self, seq_id) -> bool:
        slot = self.drafter._slots.get((self.tenant, seq_id))
        return slot is not None and self.drafter._native.contains(self.index, slot)

    @property
    def num_tokens(self) -> int:
        return self.drafter._native.tree_tokens(self.index)

    def remove(self, seq_id) -> None:
        d = self.drafter
        slot = d._slots.get((self.tenant, seq_id))
        if slot is None:
            return
        d._native.remove(self.index, slot)
        if d._requests.get(seq_id) != (self.tenant, slot):  # not in flight: its slot goes too
            del d._slots[(self.tenant, seq_id)]
