"""Placement of rollout requests on replicas: which replica runs a request, and in what order each
replica admits the requests placed on it.

A synchronous RL step ends when its last trajectory does, and every turn of a multi-turn trajectory
re-sends the whole context so far. WAR's cache-aware placement (`CacheAware`) therefore weighs:

- **cache locality**: the share of the prompt already cached on the replica (a group's shared
  prompt, a trajectory's earlier turns), from a `PrefixIndex` of what each replica computed;
- **load**: requests placed on the replica and not finished, over its batch capacity;
- **trajectory progress**: each replica admits its requests most-progressed first (later turns,
  then longer contexts), so the tail trajectories that decide the step's end get room first.

    score(replica) = locality * cached_prompt_share - load * outstanding / capacity

the same form as the Talaria router's locality and pressure terms (scheduler/router.py), with no
residency term: every replica serves the one policy. Ties go to the less loaded replica, then the
lower index. With `steal` (CacheAware), the service lets a replica with an idle slot and nothing
queued take a waiting request from a full one. `RoundRobin` and `LeastLoaded` are the baselines;
they admit in arrival order.
"""
from __future__ import annotations

import collections
import dataclasses
import hashlib
import itertools
from collections.abc import Sequence

import numpy as np

__all__ = ["BlockKeys", "CacheAware", "LeastLoaded", "Placement", "PlacementRequest", "PrefixIndex", "ReplicaLoad",
           "RoundRobin", "StickyLeastLoaded", "make_placement", "PLACEMENTS"]


@dataclasses.dataclass(frozen=True)
class PlacementRequest:
    """What placement sees of a request: its prompt, the trajectory (or group) it belongs to, and its
    progress (`turn`: model turns of its trajectory before this one). `keys`: the prompt's block keys
    (`BlockKeys`), where the caller keeps them; computed from the prompt otherwise."""
    prompt: tuple[int, ...]
    trajectory: str | None = None
    turn: int = 0
    arrival: int = 0
    keys: Sequence[bytes] | None = None


@dataclasses.dataclass(frozen=True)
class ReplicaLoad:
    outstanding: int  # placed on the replica and not finished (queued or running)
    capacity: int  # sequences it runs at once (EngineConfig.max_seqs)

    @property
    def share(self) -> float:
        return self.outstanding / max(1, self.capacity)


class BlockKeys:
    """The block keys of a token sequence that grows (a trajectory's context): block i's key is a
    digest of the first (i+1) * block tokens, each block hashed once however often the sequence grows.
    `keys` lists the whole blocks' keys so far."""

    def __init__(self, block: int, tokens: Sequence[int] = ()):
        self.block = block
        self.keys: list[bytes] = []
        self._hash = hashlib.blake2b(digest_size=16)
        self._tail: list[int] = []  # tokens past the last whole block
        self.extend(tokens)

    def extend(self, tokens: Sequence[int]) -> None:
        self._tail.extend(tokens)
        whole = len(self._tail) // self.block * self.block
        if not whole:
            return
        data, width = np.asarray(self._tail[:whole], dtype=np.int64).tobytes(), 8 * self.block
        for i in range(0, len(data), width):
            self._hash.update(data[i:i + width])
            self.keys.append(self._hash.copy().digest())
        del self._tail[:whole]


class PrefixIndex:
    """Which token prefixes a replica has computed, in blocks of `block` tokens (the engine's page
    size): block i is keyed by a digest of the prompt's first (i+1) * block tokens (`BlockKeys`), so a
    lookup counts the leading blocks present. Bounded to `capacity_blocks` (about the replica's KV
    pages), least recently used out first, like the prefix cache it approximates: of one prefix, the
    last blocks go first (blocks are counted as used from the last to the first, as a prefix tree
    evicts its leaves). Approximate by design (the replica may have evicted a block the index still
    holds): it steers placement, never correctness."""

    def __init__(self, block: int, capacity_blocks: int):
        if block < 1 or capacity_blocks < 1:
            raise ValueError(f"PrefixIndex: block ({block}) and capacity_blocks ({capacity_blocks}) must be >= 1")
        self.block, self.capacity = block, capacity_blocks
        self._blocks: collections.OrderedDict[bytes, None] = collections.OrderedDict()

    def keys(self, tokens: Sequence[int]) -> list[bytes]:
        """The keys of `tokens`' whole blocks (`match` takes them, for one prompt looked up in many indexes)."""
        return BlockKeys(self.block, tokens).keys

    def match(self, tokens: Sequence[int], keys: Sequence[bytes] | None = None, touch: bool = True) -> int:
        """Leading tokens of `tokens` held, in whole blocks (`keys`: their `keys`, when known). `touch`:
        the blocks found count as used now (a lookup that only compares replicas leaves them)."""
        found = []
        for key in self.keys(tokens) if keys is None else keys:
            if key not in self._blocks:
                break
            found.append(key)
        if touch:
            for key in reversed(found):
                self._blocks.move_to_end(key)
        return len(found) * self.block

    def insert(self, tokens: Sequence[int], keys: Sequence[bytes] | None = None) -> list[bytes]:
        """Adds the blocks of a prefix (or counts them as used now), the first most recently used; the
        keys it dropped to stay within capacity."""
        for key in reversed(self.keys(tokens) if keys is None else keys):
            self._blocks[key] = None
            self._blocks.move_to_end(key)
        return self.evict(len(self._blocks) - self.capacity) if len(self._blocks) > self.capacity else []

    def evict(self, count: int) -> list[bytes]:
        """Drops up to `count` blocks, least recently used first; the keys dropped."""
        out = list(itertools.islice(self._blocks, count))
        for key in out:
            del self._blocks[key]
        return out

    def discard(self, keys: Sequence[bytes]) -> None:
        for key in keys:
            self._blocks.pop(key, None)

    def __contains__(self, key: bytes) -> bool:
        return key in self._blocks

    def clear(self) -> None:
        self._blocks.clear()

    def __len__(self) -> int:
        return len(self._blocks)


class Placement:
    """Chooses a replica per request (`choose`: `loads` has one entry per replica, None for one that
    is gone, and at least one is not None) and each replica's admission order (`priority`, lowest
    first). `computed(replica, tokens, keys)` tells it what a replica now holds (`keys`: the tokens'
    `BlockKeys`, when known), `evicted(replica, keys)` which blocks a replica dropped, where its engine
    says; `reset()` forgets it (new weights make every cached prefix stale)."""

    name = "placement"
    steal = False  # whether a replica with an idle slot and nothing queued takes another's waiting request

    def choose(self, req: PlacementRequest, loads: Sequence[ReplicaLoad | None]) -> int:
        raise NotImplementedError

    def priority(self, req: PlacementRequest) -> tuple:
        return (req.arrival,)

    def computed(self, replica: int, tokens: Sequence[int], keys: Sequence[bytes] | None = None) -> None:
        pass

    def evicted(self, replica: int, keys: Sequence[bytes]) -> None:
        pass

    def reset(self) -> None:
        pass


class RoundRobin(Placement):
    """Replica i, i+1, ... in turn, blind to load and cache: data-parallel rollouts' default."""

    name = "round_robin"

    def __init__(self):
        self._next = itertools.count()

    def choose(self, req: PlacementRequest, loads: Sequence[ReplicaLoad | None]) -> int:
        while True:
            r = next(self._next) % len(loads)
            if loads[r] is not None:
                return r


def _least_loaded(loads: Sequence[ReplicaLoad | None], among: Sequence[int] | None = None) -> int:
    among = [r for r in (range(len(loads)) if among is None else among) if loads[r] is not None]
    return min(among, key=lambda r: (loads[r].share, r))


class LeastLoaded(Placement):
    """The replica with the smallest outstanding share of its capacity."""

    name = "least_loaded"

    def choose(self, req: PlacementRequest, loads: Sequence[ReplicaLoad | None]) -> int:
        return _least_loaded(loads)


class StickyLeastLoaded(Placement):
    """A trajectory's first request to the least loaded replica, its later ones to the same replica
    while it lives: the session-sticky, least-requests routing RL frameworks default to (verl,
    NeMo-RL), blind to what each replica has cached beyond that."""

    name = "sticky_least_loaded"

    def __init__(self):
        self._home: dict[str, int] = {}

    def choose(self, req: PlacementRequest, loads: Sequence[ReplicaLoad | None]) -> int:
        home = self._home.get(req.trajectory) if req.trajectory is not None else None
        if home is None or home >= len(loads) or loads[home] is None:
            home = _least_loaded(loads)
            if req.trajectory is not None:
                self._home[req.trajectory] = home
        return home

    def reset(self) -> None:
        self._home.clear()


class CacheAware(Placement):
    """WAR's placement (module docstring). `block` and `capacity_blocks` size each replica's
    `PrefixIndex` (the engine's page size and page count)."""

    name = "cache_aware"
    steal = True

    def __init__(self, num_replicas: int, block: int, capacity_blocks: int, locality: float = 1.0,
                 load: float = 1.0):
        """Weights of the locality and load terms (see the module docstring).

        Raises:
            ValueError: a negative weight.
        """
        if locality < 0 or load < 0:
            raise ValueError(f"CacheAware: weights must be >= 0, got locality={locality}, load={load}")
        self.locality, self.load = locality, load
        self.index = [PrefixIndex(block, capacity_blocks) for _ in range(num_replicas)]

    def score(self, req: PlacementRequest, replica: int, load: ReplicaLoad, keys: Sequence[bytes] | None = None
              ) -> float:
        hit = self.index[replica].match(req.prompt, keys, touch=False) / max(1, len(req.prompt))
        return self.locality * hit - self.load * load.share

    def choose(self, req: PlacementRequest, loads: Sequence[ReplicaLoad | None]) -> int:
        keys = req.keys if req.keys is not None else self.index[0].keys(req.prompt)  # every index: one block size
        scores = {r: self.score(req, r, load, keys) for r, load in enumerate(loads) if load is not None}
        best = max(scores.values())
        return _least_loaded(loads, [r for r, s in scores.items() if s >= best - 1e-9])

    def priority(self, req: PlacementRequest) -> tuple:
        return (-req.turn, -len(req.prompt), req.arrival)

    def computed(self, replica: int, tokens: Sequence[int], keys: Sequence[bytes] | None = None) -> None:
        self.index[replica].insert(tokens, keys)

    def evicted(self, replica: int, keys: Sequence[bytes]) -> None:
        self.index[replica].discard(keys)

    def reset(self) -> None:
        for index in self.index:
            index.clear()


PLACEMENTS = ("cache_aware", "round_robin", "least_loaded", "sticky_least_loaded")


def make_placement(name: str, num_replicas: int, block: int = 16, capacity_blocks: int = 1 << 16) -> Placement:
    """A placement by name (PLACEMENTS); ValueError naming the choices otherwise."""
    if name == "cache_aware":
        return CacheAware(num_replicas, block, capacity_blocks)
    if name == "round_robin":
        return RoundRobin()
    if name == "least_loaded":
        return LeastLoaded()
    if name == "sticky_least_loaded":
        return StickyLeastLoaded()
    raise ValueError(f"placement must be one of {', '.join(PLACEMENTS)}, got {name!r}")
