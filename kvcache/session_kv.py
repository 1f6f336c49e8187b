"""``SessionKV``: the one owner of where each session's KV lives on an instance, across its models.

A session's KV can sit in two places: full pages in a model's device prefix cache (shared by every
model's engine through one KV arena), and its last host copy (a ``HostKV`` in that model's host tier,
all tiers under one ``HostBudget``). The owner builds each model's prefix cache and host tier, which
the model's engine is then handed, and keeps per session what the scheduler asks about: which model
its last call ran on, its host copy on each model it ran on, and how long it is protected. It answers one question for both
places at once (`locate`: device tokens and host tokens, as sglang's `match_prefix` answers device and
host hits in one result), and is the one place that protects, expires and forgets a session's KV.

Deadlines are on the owner's `clock` (an instance's replay clock, or the wall clock), the same clock
its prefix caches evict by.
"""
from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence

import numpy as np

from talaria_jax.kvcache.host_tier import HostBudget, HostKV, HostTier, host_memory_kind
from talaria_jax.kvcache.pool import KVArena
from talaria_jax.kvcache.prefix import PrefixCache

__all__ = ["ModelKV", "SessionKV"]


@dataclasses.dataclass(frozen=True)
class ModelKV:
    """One model's KV homes on the instance: its device prefix cache and its host tier."""
    prefix_cache: PrefixCache
    host_tier: HostTier

    def key(self, tenant: str | None) -> tuple:
        """The prefix-cache key of the model's sequences for `tenant` (``KVSource.prefix_key``)."""
        return self.host_tier.source.prefix_key(tenant)


class SessionKV:
    """Where each session's KV is on one instance; see the module docstring.

    `host_kv_bytes`: the most host memory all models' session copies hold together (None: unbounded);
    past it the least recently used copies are evicted (protected ones last)."""

    def __init__(self, arena: KVArena, *, clock: Callable[[], float], host_kv_bytes: int | None = None):
        self.arena, self.clock = arena, clock
        self.budget = HostBudget(host_kv_bytes)
        self.use_host = True  # whether host copies are kept and restored (a policy may turn it off)
        self.models: dict[str, ModelKV] = {}
        self._host: dict[str, dict[str, HostKV]] = {}  # session -> model -> its last host copy of that model
        self._model_of: dict[str, str] = {}  # session -> the model of its last call here
        self._until: dict[str, dict[str, float]] = {}  # session -> model -> the end of its protection there

    def add_model(self, model: str, cfg, *, weights: str) -> ModelKV:
        """Builds the prefix cache and host tier of `model` (`cfg`: its ``ModelConfig``, `weights`: its
        fingerprint) over the arena, for the model's engine to be handed. Where the devices have no
        host memory, the tier keeps its own (empty) grant of device memory instead of the budget."""
        if model in self.models:
            raise ValueError(f"model {model!r} already has its KV homes")
        spec = self.arena.spec_for(cfg)
        mesh = self.arena.mesh
        tier = HostTier(spec, mesh, model=cfg.name, weights=weights,
                        budget=self.budget if host_memory_kind(mesh) is not None else None)
        kv = ModelKV(PrefixCache(self.arena.allocator, spec.page_size, clock=self.clock), tier)
        self.models[model] = kv
        return kv

    # -- where a session's KV is ---------------------------------------------------------------------

    def model_of(self, session: str) -> str | None:
        """The model of the session's last call here (None: none yet)."""
        return self._model_of.get(session)

    def device_tokens(self, model: str, tenant: str | None, tokens: Sequence[int]) -> int:
        """Leading tokens of `tokens` whose full pages `model`'s prefix cache holds for `tenant`."""
        kv = self.models[model]
        return kv.prefix_cache.peek(kv.key(tenant), tokens)

    def with_host_copy(self) -> set[str]:
        """The sessions that have a host copy (evicted or not)."""
        return set(self._host)

    def host_copy(self, session: str, model: str) -> HostKV | None:
        """The session's host copy, if host copies are on, it is of `model`, and it was not evicted."""
        kv = self._host.get(session, {}).get(model)
        if not self.use_host or kv is None or not self.models[model].host_tier.usable(kv):
            return None
        return kv

    def locate(self, session: str, model: str, tenant: str | None, tokens: Sequence[int]) -> tuple[int, int]:
        """(device tokens, host tokens) of `tokens` (the session's context) held for `model`: the host
        copy counts as far as it agrees with `tokens` (a compaction since may have cut the context)."""
        kv = self.host_copy(session, model)
        return self.device_tokens(model, tenant, tokens), _common(kv, tokens, len(tokens)) if kv is not None else 0

    def restorable(self, session: str, model: str, prompt: Sequence[int]) -> HostKV | None:
        """The part of the session's host copy that `prompt` extends: its longest common prefix with the
        prompt's tokens but the last (a chat template may render the last reply differently from the
        tokens generated, so a copy is rarely a prefix of the next prompt whole); None if nothing."""
        kv = self.host_copy(session, model)
        if kv is None:
            return None
        n = _common(kv, prompt, len(prompt) - 1)
        return kv.prefix(n) if n > 0 else None

    # -- what happens to it --------------------------------------------------------------------------

    def started(self, session: str, model: str) -> None:
        """A call of the session was handed to `model`'s engine."""
        self._model_of[session] = model

    def kept(self, session: str, model: str, tenant: str | None, kv: HostKV) -> None:
        """A finished call wrote its KV through to host (`kv`): it becomes the session's copy of `model`
        (the one it replaces is released; its copies of other models stay), and the device cache's
        pages it backs may be evicted first."""
        mkv = self.models[model]
        mkv.prefix_cache.mark_backed(mkv.key(tenant), kv.token_ids, lambda: mkv.host_tier.usable(kv))
        mine = self._host.setdefault(session, {})
        old = mine.get(model)
        mine[model] = kv
        if old is not None and old is not kv:
            mkv.host_tier.release(old)

    def protect(self, session: str, until: float, tenant: str | None, tokens: Sequence[int]) -> None:
        """Keeps the session's device pages on the path of `tokens` (its context on the model of its
        last call here, the one it is expected back on) until `until`, and its host copies while any
        protection of it lasts. A protection given earlier on another model runs to its own deadline."""
        model = self._model_of.get(session)
        if model is None:
            return
        self._until.setdefault(session, {})[model] = until
        mkv = self.models[model]
        mkv.prefix_cache.protect_path(mkv.key(tenant), tokens, until)
        mkv.host_tier.protect(session)

    def protected(self) -> list[tuple[str, str]]:
        """(session, model) of each protection that lasts past now."""
        now = self.clock()
        return [(s, m) for s, mine in self._until.items() for m, until in mine.items() if until > now]

    def expire(self) -> None:
        """Ends the protections whose deadline has passed (a session's host copies, with its last)."""
        now = self.clock()
        for session, mine in list(self._until.items()):
            for model in [m for m, until in mine.items() if until <= now]:
                del mine[model]
            if not mine:
                del self._until[session]
                self._unprotect_host(session)

    def forget(self, session: str) -> None:
        """The session will not return: its host copy is released and its protection ended. Its device
        pages stay in the prefix cache (protected until the deadline given last), evicted as others."""
        for model, kv in self._host.pop(session, {}).items():
            self.models[model].host_tier.release(kv)
        self._unprotect_host(session)
        self._model_of.pop(session, None)
        self._until.pop(session, None)

    def drop_device(self, model: str) -> None:
        """Empties `model`'s device prefix cache (its pages go back to the arena)."""
        self.models[model].prefix_cache.clear()

    def clear(self) -> None:
        """Forgets every session and empties every cache (no call may be in flight)."""
        for session in list(self._model_of) + list(self._host):
            self.forget(session)
        for mkv in self.models.values():
            mkv.prefix_cache.clear()
        self._until.clear()

    def _unprotect_host(self, session: str) -> None:
        for mkv in self.models.values():  # (the session may have run on several models)
            mkv.host_tier.protect(session, False)


def _common(kv: HostKV, tokens: Sequence[int], limit: int) -> int:
    """How many leading tokens of the host copy `kv` equal `tokens`', up to `limit`."""
    m = max(0, min(kv.num_tokens, limit))
    differ = np.flatnonzero(np.asarray(tokens[:m]) != np.asarray(kv.token_ids[:m]))
    return int(differ[0]) if differ.size else m
