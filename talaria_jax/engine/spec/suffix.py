"""Suffix-tree drafts for speculative decoding: no draft model, only the text already seen.

SuffixDecoding (Oliaro et al., 2024; arctic-inference's `SuffixDecodingCache`) drafts from two
trees: a global one over the responses of earlier and in-flight requests (sibling rollouts of one
prompt, a session's earlier calls) and one per request over its own prompt and output. Agents
repeat file contents, diffs and test output, so the last few tokens of a request often occurred
before, and what followed them then is a good guess of what follows now.

`SuffixTree` is a depth-bounded suffix trie: every substring of at most `max_depth` tokens of its
sequences is a path from the root, and each node counts how often its substring occurs. Appending a
token costs O(max_depth) (one step down from each live suffix), and each node keeps a suffix link
(the node of its substring minus the first token), so the nodes of every suffix of a pattern are
found in one walk plus a chain of links. A draft follows the most frequent children from the node
of a matched suffix while the product of the branch frequencies stays at least `min_token_prob`,
up to `max_spec_factor` x the match length tokens: a chain (one child per step) or a tree (the most
likely nodes first, each child scored by its path's probability).

`SuffixDrafter` keeps the trees of one engine: one global tree per tenant (a request's
`cache_salt`: no tenant drafts from another's text), with bounded memory (the oldest finished
responses are evicted first), and a tree per request. `draft()` drafts a whole batch in one call.
"""
from __future__ import annotations

import collections
import dataclasses
import heapq
import itertools
from collections.abc import Sequence

import numpy as np

MAX_DRAFT_TOKENS = 31  # the verifier's ancestor mask is one int32 bit per draft token (plus the root)


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
        if self.max_spec_factor <= 0:
            raise ValueError(f"SpecConfig.max_spec_factor must be > 0, got {self.max_spec_factor}")
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
        return cls(np.zeros(0, np.int32), np.zeros(0, np.int32), np.zeros(0, np.float32))


class SuffixTree:
    """A depth-bounded suffix trie with counts and suffix links over several token sequences.

    A node is an int, and the trie is flat: one dict from (node, token) to child, and a list per
    field (count, depth, suffix link, first child, next sibling, token), so a trie of millions of
    nodes holds no Python objects the garbage collector walks (a node object each made the
    collector's passes cost as much as the insertions)."""

    def __init__(self, max_depth: int = 64):
        self.max_depth = max_depth
        self.root = 0
        self._child: dict[int, int] = {}  # node << 32 | token -> child
        self._count, self._depth, self._link = [0], [0], [0]
        self._first, self._next, self._token = [-1], [-1], [-1]  # children as a linked list, for drafting
        self._free: list[int] = []  # ids of removed nodes, reused first
        self._tokens: dict[object, list[int]] = {}
        self._live: dict[object, list[int]] = {}  # per sequence: nodes of its suffixes shorter than max_depth
        self._last: dict[object, int] = {}  # per sequence: the node of its longest indexed suffix
        self.num_nodes = 1
        self.num_tokens = 0
        self.ops = _TrieOps(self)

    def __contains__(self, seq_id) -> bool:
        return seq_id in self._tokens

    def depth(self, node: int) -> int:
        """The length of the node's substring."""
        return self._depth[node]

    def extend(self, seq_id, tokens: Sequence[int]) -> None:
        """Appends tokens to sequence seq_id (a new one if unknown): each suffix ending at a new token
        is counted once more."""
        toks = self._tokens.setdefault(seq_id, [])
        live = self._live.setdefault(seq_id, [0])  # shortest first: the root is the empty suffix
        get, child_of, count, cap = self._child.get, self._child, self._count, self.max_depth - 1
        depth, link, first, nxt_sib, token, free = (self._depth, self._link, self._first, self._next, self._token,
                                                    self._free)
        created = 0
        for t in tokens:
            t = int(t)
            toks.append(t)
            count[0] += 1
            nxt, below = [0], 0
            for node in live:  # shortest first, so each new child's suffix link (the shorter one) exists
                key = node << 32 | t
                child = get(key)
                if child is not None:
                    count[child] += 1
                elif free:
                    child = free.pop()
                    count[child], depth[child], link[child], token[child] = 1, depth[node] + 1, below, t
                    first[child], nxt_sib[child], first[node] = -1, first[node], child
                    child_of[key] = child
                    created += 1
                else:
                    child = len(count)
                    count.append(1)
                    depth.append(depth[node] + 1)
                    link.append(below)
                    first.append(-1)
                    nxt_sib.append(first[node])
                    token.append(t)
                    first[node] = child_of[key] = child
                    created += 1
                below = child
                nxt.append(child)
            if len(live) > cap:  # live[i] is the suffix of i tokens: its child is at max_depth
                nxt.pop()
            live = nxt
        self._live[seq_id] = live
        if tokens:
            self._last[seq_id] = below
        self.num_nodes += created
        self.num_tokens += len(tokens)

    def remove(self, seq_id) -> None:
        """Forgets a sequence: its suffixes' counts go down, and nodes no sequence reaches are freed."""
        toks = self._tokens.pop(seq_id, None)
        self._live.pop(seq_id, None)
        self._last.pop(seq_id, None)
        if toks is None:
            return
        count = self._count
        count[0] -= len(toks)
        self.num_tokens -= len(toks)
        for i in range(len(toks)):
            node = 0
            for t in toks[i:i + self.max_depth]:
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
            self._free.append(x)
            self.num_nodes -= 1
            c = first[x]
            while c != -1:
                stack.append((x, c))
                c = nxt[c]

    def match(self, pattern: Sequence[int]) -> list[int]:
        """Nodes of the pattern's suffixes that occur, longest first (`depth(node)` is the match length)."""
        pattern = pattern[-self.max_depth:]
        get, depth = self._child.get, self._depth
        # The longest suffix that occurs: any substring of an indexed substring is indexed, so if
        # pattern[i:] occurs then so does pattern[j:] for j > i. It is mostly short: try the suffixes
        # of up to 8 tokens, each from the root, shortest first.
        p, node, short = len(pattern), 0, min(len(pattern), 8, self.max_depth - 1)
        for k in range(1, short + 1):
            x = 0
            for t in pattern[p - k:]:
                x = get(x << 32 | t)
                if x is None:
                    return self._links(node)
            node = x
        if short == p:
            return self._links(node)
        # Else walk from the left, restarting via suffix links on a miss (Aho-Corasick style over a
        # trie that contains every substring).
        node = 0
        for t in pattern:
            while node and (depth[node] >= self.max_depth or get(node << 32 | t) is None):
                node = self._link[node]
            node = get(node << 32 | t, 0) if depth[node] < self.max_depth else 0
        return self._links(node)

    def _links(self, node: int) -> list[int]:
        """node and the nodes of its suffixes, longest first (the root left out)."""
        out, link = [], self._link
        while node:
            out.append(node)
            node = link[node]
        return out

    def match_own(self, seq_id, pattern: Sequence[int]) -> list[int]:
        """match(pattern), mostly without walking the pattern when it ends with sequence seq_id's last
        r = min(len, max_depth) tokens (a request's context and its response in the global tree): that
        suffix is indexed, so the answer is its node and links, unless the pattern's suffix of r + 1
        tokens (one token from before the sequence) occurs too; then (rarely) the full walk, as for a
        pattern that does not end with the sequence."""
        node = self._last.get(seq_id)
        pattern = list(pattern[-self.max_depth:])
        r = 0 if node is None else self._depth[node]
        if not 0 < r <= len(pattern) or pattern[len(pattern) - r:] != self._tokens[seq_id][-r:]:  # not its end
            return self.match(pattern)
        if r < len(pattern):
            x = 0
            for t in pattern[len(pattern) - r - 1:]:
                x = self._child.get(x << 32 | t)
                if x is None:
                    break
            else:
                return self.match(pattern)
        return self._links(node)

    def draft(self, pattern: Sequence[int], max_tokens: int, cfg: SpecConfig, seq_id=None,
              floor: float = 0.0) -> Draft:
        """The best draft after pattern scoring above floor, else an empty one (seq_id: a sequence the
        pattern likely ends with, see match_own)."""
        nodes = self.match(pattern) if seq_id is None else self.match_own(seq_id, pattern)
        depth, count = self._depth, self._count
        return _best_draft([(depth[n], count[n], n) for n in nodes], self.ops, max_tokens, cfg, self.max_depth, floor)


class _TrieOps:
    """Counts and children of a trie's nodes (the draft functions' view of a node)."""
    def __init__(self, tree: SuffixTree):
        self.tree = tree

    def count(self, node: int) -> int:
        return self.tree._count[node]

    def children(self, node: int, min_count: float = 0) -> list[tuple[int, int, int]]:
        """(token, count, child) of the children occurring at least min_count times."""
        tr, out = self.tree, []
        count, c = tr._count, tr._first[node]
        while c != -1:
            if count[c] >= min_count:
                out.append((tr._token[c], count[c], c))
            c = tr._next[c]
        return out

    def going_on(self, node: int) -> int:
        """How many of the node's occurrences have a next token (an upper bound where that is slow)."""
        tr = self.tree
        total, n, c = 0, 0, tr._first[node]
        while c != -1:
            n += 1
            if n > 8:
                return tr._count[node]
            total += tr._count[c]
            c = tr._next[c]
        return total

    def best_child(self, node: int) -> tuple[int, int, int] | None:
        """The most frequent child (ties: the smaller token), or None."""
        kids = self.children(node)
        return max(kids, key=lambda k: (k[1], -k[0])) if kids else None

    def run(self, node: int, n: int, p: float, min_prob: float, above: float = -1.0):
        """The steps below node (at most n) while each has one child only, so its path probability is
        p x child count / node's count: tokens, path probabilities (each >= min_prob and > above) and
        the last node. A chain of such steps (one in a trie, a run of equal tokens after every
        occurrence in a scan) is taken at once."""
        tr = self.tree
        count, first, nxt, token = tr._count, tr._first, tr._next, tr._token
        toks, probs, c0 = [], [], count[node]
        while len(toks) < n:
            child = first[node]
            if child == -1 or nxt[child] != -1:
                break
            q = p * count[child] / c0
            if q < min_prob or q <= above:
                break
            toks.append(token[child])
            probs.append(q)
            node = child
        return toks, probs, node


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
    over it would give, without building one (a trie costs O(max_depth) nodes per token: ~0.3 s per
    thousand prompt tokens in Python; a scan of 100K tokens is one vectorised compare)."""

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
        text, rev = self.text, np.asarray(pattern[-self.max_depth:][::-1], np.int32)  # rev[j]: j tokens back
        n, p, buf, pad = self._n, len(rev), self._buf, self.max_depth
        if not p or not n:
            return
        ends, m = np.flatnonzero(text == rev[0]), 1  # the occurrences of the last m tokens
        shorter = []  # shorter[v - 1]: the occurrences of the last v tokens, for v < m
        while len(ends) > 16 and m < p:  # many occurrences: narrow them one token at a time
            shorter.append(ends)
            ends, m = ends[buf[ends + (pad - m)] == rev[m]], m + 1
        last = -1
        if len(ends):  # a few left: the match length of each at once
            eq = buf[(ends + pad)[:, None] - self._back[m:p]] == rev[m:p]
            lens = (m + np.cumprod(eq, axis=1).sum(1)).tolist()
            if ends[-1] == n - 1:  # the text's own end (ends are sorted): no longer than any other match
                lens[-1] = min(lens[-1], max(lens[:-1], default=0))
            ends = ends.tolist()
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
        return _best_draft(self._levels(pattern), _ScanOps(self._list), max_tokens, cfg, None, floor)


def _best_draft(matches, ops, max_tokens: int, cfg: SpecConfig, max_depth: int | None = None,
                floor: float = 0.0) -> Draft:
    """The best-scoring draft over the matched suffixes (longest first; on equal scores the longer match,
    as arctic-inference). A shorter match that occurs no more often continues exactly like the longer
    one but may draft fewer tokens, so it is skipped, unless the longer one's draft may have been cut
    by the trie's depth (a node at depth d has descendants down to max_depth only: the shorter match
    has more room). No draft of a match scores more than its token limit x the share of its
    occurrences that go on (each token's path probability is at most that): a match whose bound is
    not above the best score so far is skipped, and once the limit alone is not, the search stops
    (every shorter match has a lower limit). Only drafts scoring above floor count (else: empty)."""
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

    def __init__(self, cfg: SpecConfig = SpecConfig()):
        cfg.validate()
        self.cfg = cfg
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
