"""``Instance``: the scheduler's ``InstanceAPI`` over real JAX engines, several models on one mesh.

One instance serves one model at a time out of one weight slot (``talaria_jax.weights.slot``): a
preallocated flat device buffer per shard, shared by models of any shape, that each model's runner
carves its parameters from inside the jitted step, so the slot's addresses never change. Every
model's weights wait in pinned host memory; `stage_model` copies the next one host-to-device into a
staging area while the current one serves, and the switch then moves it device-to-device into the
slot (without staging, the switch loads it from host memory). On a CPU, `resident=True` keeps each
model in arrays of its own instead, read as they are by every step (no carving): every model on the
devices, so a switch moves nothing, or, with `weight_budget_bytes`, as many as the budget holds
(``talaria_jax.weights.budget``): a switch to one that is not evicts the least recently used and copies
it from host memory, as on a GPU, and staging starts that copy early where the budget has room.

Each model has its own `Engine` (continuous batching, prefix cache on, a host tier): a call becomes
one request whose prompt is its session's real history (earlier prompts and the tokens the model
actually generated) extended by deterministic tokens (`SessionTokens`). With `host_kv`, every
finished call writes its KV through to host memory, so a switch never loses a session's KV: when
the session returns, the full pages of its prefix still in the device prefix cache are reused and the
rest is restored from the host copy, instead of being recomputed. A session that calls several
models has a history, device pages and a host copy per model. `protect_kv` protects a session's
device pages on the model of its last call (its prefix-cache path) until the time given, and its
host copies while a protection of it lasts.

Work happens in chunks, as in ``SimInstance``: `start_chunk` carries out what the scheduler asked
for since the last one (admissions, staging, a switch), then runs one real step (a switch, or one
engine step) and returns when it ended on the replay's clock: `now` plus the measured seconds. So
instances stepped one after another in one process replay as if they ran side by side.

All models' engines share one KV arena (``talaria_jax.kvcache.pool.KVArena``): one donated buffer of
uniform byte pages and one page allocator, so the scheduler's page budget is the device's. A page
holds `engine_config.page_size` tokens of the model with the most KV bytes per token and as many
tokens of each other model as fit the same bytes; when the active model runs short, the cached pages
of every model are evicted in one order (unprotected, host-backed, least recently used first).
"""
from __future__ import annotations

import array
import dataclasses
import hashlib
import math
import time
from collections.abc import Callable, Mapping, Sequence

import jax

from talaria_jax.engine.compile_cache import compile_seconds
from talaria_jax.engine.engine import CheckedRequest, Engine, EngineConfig, RequestOutput
from talaria_jax.engine.sampling import SamplingParams
from talaria_jax.kvcache.pool import KVArena
from talaria_jax.kvcache.session_kv import SessionKV
from talaria_jax.models.model import ShardedModel
from talaria_jax.scheduler.api import DerivedQueries, InstanceStats, PrefixLocation, WeightState
from talaria_jax.scheduler.session import Call
from talaria_jax.sharding import make_mesh
from talaria_jax.sim.cost import CostModel
from talaria_jax.sim.hardware import HardwareConfig, ModelShape
from talaria_jax.sim.instance import Switch
from talaria_jax.tokenizer import Tokenizer
from talaria_jax.weights.budget import DeviceWeights, held_bytes
from talaria_jax.weights.named import load_model
from talaria_jax.weights.slot import HostWeights, SlotLayout, WeightSlot, without_weights, word_for

__all__ = ["LOCAL_KV_BYTES", "Instance", "LiveTokens", "SessionTokens", "build_instances", "shapes_of",
           "check_weight_budget", "resolve_weight_budget"]

LOCAL_KV_BYTES = 512 * 2**20  # an instance's KV arena per device, all models: ~11K tokens of SmolLM2 (fp32, 45 KiB a token)


class SessionTokens:
    """Token ids of every session, shared by all instances (a session may move between them).

    A call's prompt is the session's history on the call's model (its last prompt there plus the
    tokens generated for it) and then deterministic tokens, a function of (seed, session, position), up
    to `prompt_tokens`: the tool's observation (and what the session's other models said since). So a
    session's every next prompt on a model extends its last context there, as an agent's does; a call
    that compacts its context (``Call.prefix_tokens``) keeps only that much of the history, on every
    model of the session, and continues with tokens of its own (a function of (seed, session, turn,
    position)). The first `shared_prefix` positions are the same in every session: a system prompt all
    share."""

    def __init__(self, seed: int = 0, shared_prefix: int = 0, tenant: Callable[[str], str | None] | None = None):
        """`tenant(session)`: the prefix-cache salt of a session's calls (default: one tenant, None)."""
        self.seed, self.shared_prefix = seed, shared_prefix
        self._tenant = tenant
        self.history: dict[str, dict[str, list[int]]] = {}  # session -> model -> its last context there
        self._cut: dict[str, set[str]] = {}  # session -> the models whose history a compaction cut since

    def context(self, session: str, model: str) -> Sequence[int]:
        """The session's last context on `model` (its last prompt and output there; empty if none)."""
        return self.history.get(session, {}).get(model, ())

    def tenant(self, session: str) -> str | None:
        return self._tenant(session) if self._tenant is not None else None

    def returns(self, session: str) -> bool:
        """Whether the session may call again (its KV is worth keeping): a replayed one may."""
        return True

    def token(self, session: str, position: int, vocab: int) -> int:
        owner = "" if position < self.shared_prefix else session
        d = hashlib.blake2b(f"{self.seed}:{owner}:{position}".encode(), digest_size=8).digest()
        return int.from_bytes(d, "little") % vocab

    def prompt(self, call: Call, vocab: int) -> list[int]:
        h = list(self.context(call.session, call.model))
        owner = call.session
        if call.prefix_tokens is not None or call.model in self._cut.get(call.session, ()):
            # a new prefix: the kept part of the history, then the summary
            h, owner = h[:call.max_prefix_tokens], f"{call.session}/{call.turn}"
        if len(h) > call.prompt_tokens:
            raise ValueError(f"call {call.key}: prompt_tokens={call.prompt_tokens} is shorter than the "
                             f"{len(h)} tokens the session already holds")
        return h + [self.token(owner, p, vocab) for p in range(len(h), call.prompt_tokens)]

    def request(self, call: Call, engine: Engine) -> CheckedRequest:
        """The call's prompt, decoded greedily for exactly its trace's output tokens, checked by
        `engine` (the one check a replayed call gets)."""
        return engine.check_request(self.prompt(call, engine.model.cfg.vocab_size),
                                    SamplingParams(max_tokens=call.output_tokens, temperature=0.0, ignore_eos=True))

    def finished(self, call: Call, prompt: tuple[int, ...], output: list[int]) -> None:
        mine = self.history.setdefault(call.session, {})
        mine[call.model] = list(prompt) + list(output)
        cut = self._cut.setdefault(call.session, set())
        cut.discard(call.model)
        for m, h in mine.items():  # a compaction starts a new prefix on the session's other models too
            if m != call.model and len(h) > call.max_prefix_tokens:
                mine[m] = h[:call.max_prefix_tokens]
                cut.add(m)

    def forget(self, session: str) -> None:
        self.history.pop(session, None)
        self._cut.pop(session, None)

    def clear(self) -> None:
        """Forgets every session."""
        self.history.clear()
        self._cut.clear()


class LiveTokens:
    """The token source of an `Instance` that serves live requests (`SessionTokens` replays a trace):
    each call's real prompt and sampling parameters, and each session's last context on each model it
    used (its last prompt there and the tokens generated for it), which the instance's prefix lookups
    follow. A session's history is a compact int32 array (4 bytes a token, not a Python int's 28 and a list slot's 8): a
    server keeps up to --max_sessions sessions' histories, one per model each session used."""

    def __init__(self):
        self.history: dict[str, dict[str, array.array]] = {}  # session -> model -> its last context there
        self.calls: dict[tuple[str, int], CheckedRequest] = {}
        self._salts: dict[str, str | None] = {}
        self._single: set[str] = set()

    def begin(self, call: Call, request: CheckedRequest, *, salt: str | None, single: bool) -> None:
        """A call arrives: its request (checked by its model's engine), its session's tenant salt, and
        whether the session is this one call (its KV is not kept)."""
        self.calls[call.key] = request
        self._salts[call.session] = salt
        if single:
            self._single.add(call.session)

    def end(self, call: Call) -> None:
        """The call is done (finished or aborted): its prompt is no longer needed."""
        self.calls.pop(call.key, None)

    def forget(self, session: str) -> None:
        self.history.pop(session, None)
        self._salts.pop(session, None)
        self._single.discard(session)

    def clear(self) -> None:
        """Forgets every session (no call may be in flight)."""
        self.history.clear()
        self._salts.clear()
        self._single.clear()

    def tenant(self, session: str) -> str | None:
        return self._salts.get(session)

    def returns(self, session: str) -> bool:
        return session not in self._single

    def context(self, session: str, model: str) -> Sequence[int]:
        """The session's last context on `model` (its last prompt and output there; empty if none)."""
        return self.history.get(session, {}).get(model, ())

    def request(self, call: Call, engine: Engine) -> CheckedRequest:
        return self.calls[call.key]

    def finished(self, call: Call, prompt: tuple[int, ...], output: list[int]) -> None:
        h = array.array("i", prompt)
        h.extend(output)
        self.history.setdefault(call.session, {})[call.model] = h


@dataclasses.dataclass
class _Served:
    """One model of the instance: its engine and its host weights (`host.layout`: where it sits in the slot;
    None when the models stay resident)."""
    engine: Engine
    host: HostWeights | None
    shape: ModelShape


@dataclasses.dataclass(frozen=True)
class Step:
    """A chunk that ran one engine step; `outputs`: the requests that gained a token."""
    outputs: tuple[RequestOutput, ...]


class Instance(DerivedQueries):
    """A real instance; see the module docstring. `models` maps the trace's model names to loaded
    models, all on `mesh`'s devices. `hw` and `shapes` (the calibrated profile of this machine, e.g.
    configs/hardware/cpu.yaml) give the scheduler's estimates; `tokens` the calls' prompts and each
    session's tenant (the prefix-cache salt) and whether it returns.
    `kv_bytes_per_device` sizes the shared KV arena in bytes per device (None: as engine_config says,
    its default room for max_seqs sequences of max_model_len at page_size tokens a page).
    `host_kv_bytes` bounds the host memory of all models' session KV copies together (`kv.budget`;
    None: unbounded): past it the least recently used copies are evicted, and a copy that does not fit
    is not kept; such a session's prefix is recomputed when it returns. `tokenizers`: a model's tokenizer
    (for serving text; default: bytes). `resident`: each model keeps its own device arrays and no
    weight slot is made: for a CPU, whose device memory is host memory, and where a step over the slot
    copies every parameter (XLA:CPU has no views into a buffer: decode about 4x slower,
    docs/benchmarks/model_switch.md). Every model stays on the devices (a switch moves nothing) unless
    `weight_budget_bytes` bounds their weights' bytes over all devices: then models take turns
    (`DeviceWeights`), a switch to an evicted one copies it from host memory, and staging starts that
    copy while another model serves where the budget has room beside it.
    `exclude_compiles`: a chunk's seconds leave out the tracing and compiling inside it
    (``compile_seconds``; counted in `stats.compile_s`), as a replay's clock should: a warm server
    compiles nothing, and a step shape first met inside a measured replay would otherwise count as
    serving time. Only for one thread stepping the instances: the count is the process's."""

    def __init__(self, name: str, models: Mapping[str, ShardedModel], hw: HardwareConfig,
                 shapes: Mapping[str, ModelShape], *, engine_config: EngineConfig, tokens: SessionTokens,
                 host_kv: bool = True, staging: bool = True, drop_kv_on_switch: bool = False,
                 kv_bytes_per_device: int | None = None, host_kv_bytes: int | None = None,
                 tokenizers: Mapping[str, Tokenizer] | None = None, resident: bool = False,
                 weight_budget_bytes: int | None = None, exclude_compiles: bool = False):
        if not models:
            raise ValueError(f"instance {name}: give at least one model")
        mesh = next(iter(models.values())).mesh
        for m, model in models.items():
            if model.mesh.devices.tolist() != mesh.devices.tolist():
                raise ValueError(f"instance {name}: model {m!r} is on devices {model.mesh.devices.ravel().tolist()}, "
                                 f"not the instance's {mesh.devices.ravel().tolist()}")
        for m in models:
            if m not in shapes:
                raise ValueError(f"instance {name}: model {m!r} has no shape (the calibrated profile's models)")
        self.name, self.hw, self.cost = name, hw, CostModel(hw)
        self.tokens = tokens
        cfgs = [model.cfg for model in models.values()]
        kv_bytes = kv_bytes_per_device if kv_bytes_per_device is not None else engine_config.kv_memory_bytes_per_device
        num_pages = None if kv_bytes is not None else engine_config.num_pages or \
            engine_config.max_seqs * -(-engine_config.max_model_len // engine_config.page_size)
        self.arena = KVArena.for_models(cfgs, mesh, engine_config.page_size, num_pages=num_pages,
                                        memory_bytes_per_device=kv_bytes)
        cfg = dataclasses.replace(engine_config, prefix_cache=True, warmup=False, num_pages=None,
                                  kv_memory_bytes_per_device=None)
        if weight_budget_bytes is not None and not resident:
            raise ValueError(f"instance {name}: weight_budget_bytes needs resident=True (models in arrays of their "
                             f"own); the weight slot holds one model at a time")
        self.resident = resident
        self.exclude_compiles = exclude_compiles
        self.slot: WeightSlot | None = None
        self.weights: DeviceWeights | None = None  # with weight_budget_bytes: which models are on the devices
        self._resident_bytes = sum(map(held_bytes, models.values())) if resident else 0
        if not resident:
            # one word for all models' rows, as wide as most of their bytes (mixed precisions share a slot)
            word = word_for([leaf for model in models.values() for leaf in SlotLayout.of(model).leaves])
            layouts = {m: SlotLayout.of(model, word=word) for m, model in models.items()}
            self.slot = WeightSlot.for_layouts(mesh, layouts.values())
        # each session's KV, device and host, across the models; deadlines on the replay's clock
        self.kv = SessionKV(self.arena, clock=lambda: self.now, host_kv_bytes=host_kv_bytes)
        self.served: dict[str, _Served] = {}
        for m, model in models.items():
            kv = self.kv.add_model(m, model.cfg, weights=model.fingerprint)
            host = None
            if resident:
                eng = Engine(model, cfg, tokenizer=(tokenizers or {}).get(m), arena=self.arena, kv=kv)
            else:
                host = HostWeights.of(model, layouts[m])  # the device copy is not kept: the slot is the only one
                eng = Engine(without_weights(model), cfg, tokenizer=(tokenizers or {}).get(m), arena=self.arena,
                             kv=kv, weight_slot=(self.slot, layouts[m]))
            self.served[m] = _Served(eng, host, shapes[m])
        if weight_budget_bytes is not None:  # host copies first: each model's arrays are then freed
            self.weights = DeviceWeights(models, weight_budget_bytes,
                                         lambda m, state: self.served[m].engine.place_weights(state))
            for m in models:
                self.served[m].engine.place_weights(None)
        # the scheduler's page: one arena page over the instance's devices (ModelShape counts bytes the same way)
        self.page_bytes = self.arena.page_bytes_per_device * mesh.devices.size
        self.kv_bytes = self.arena.bytes_per_device * mesh.devices.size
        self.capacity = float(self._weight_bytes(staged=True) + self.kv_bytes)
        self.reset(host_kv=host_kv, staging=staging, drop_kv_on_switch=drop_kv_on_switch)
        if engine_config.warmup:
            self.warmup()

    def reset(self, *, host_kv: bool, staging: bool, drop_kv_on_switch: bool) -> None:
        """Empties the instance for another replay (compiled programs are kept): no model active,
        no KV on device or host, no calls, fresh stats, and the policy's mechanisms set."""
        self.staging, self.drop_kv_on_switch = staging, drop_kv_on_switch
        for s in self.served.values():
            if s.engine.has_unfinished():
                raise RuntimeError(f"instance {self.name}: reset with requests in flight")
        self.kv.clear()
        self.kv.use_host = host_kv
        if self.slot is not None:
            self.slot.drop_staged()
        if self.weights is not None:
            self.weights.evict_all()
        self._active: str | None = None
        self._staged: str | None = None  # the model in the staging area (staging or staged)
        self._stage_to: str | None = None
        self._switch_to: str | None = None
        self._pending: list[Call] = []  # admitted, not yet handed to the engine (next step boundary)
        self._calls: dict[str, Call] = {}  # request id -> call, handed to its engine
        self._reusable: dict[str, int] = {}  # request id -> prefix tokens an earlier call computed
        self.outputs: dict[tuple[str, int], RequestOutput] = {}  # call key -> its finished output
        self.step_outputs: list[tuple[Call, RequestOutput]] = []  # every output of the last chunk
        self.chunk: Switch | Step | None = None  # the chunk in flight
        self.now = 0.0
        self.busy_until: float | None = None
        self.stats = InstanceStats()

    def warmup(self) -> None:
        """Compiles every model's step shapes and host copies (each through the slot)."""
        for m, s in self.served.items():
            if self.slot is not None:
                self.slot.load(s.host)
            if self.weights is not None:
                self.weights.load(m)
            s.engine.warmup(progress=None)
        if self.weights is not None:
            self.weights.evict_all()
        self._active = self._staged = None  # the slot holds the last one warmed: the next switch loads

    def shapes(self) -> dict[str, ModelShape]:
        """The cost-model shape of each hosted model (what the simulator needs to predict this instance)."""
        return {m: s.shape for m, s in self.served.items()}

    # --- InstanceAPI: weights ---------------------------------------------------------------
    def models(self) -> tuple[str, ...]:
        return tuple(self.served)

    def active_model(self) -> str | None:
        return self._active

    def weight_state(self, model: str) -> WeightState:
        if model == self._active:
            return WeightState.ACTIVE
        if self.weights is not None:
            if self.weights.on_device(model):
                return WeightState.RESIDENT
            if model == self.weights.staging:
                return WeightState.STAGED if self.weights.staged_ready() else WeightState.STAGING
            return WeightState.HOST
        if self.resident:
            return WeightState.RESIDENT  # on the devices already: a switch moves nothing
        if model == self._staged:
            return WeightState.STAGED if self.slot.staged_ready() else WeightState.STAGING
        return WeightState.HOST

    def estimate_switch_s(self, model: str) -> float:
        s, shape = self.weight_state(model), self.served[model].shape
        if s in (WeightState.ACTIVE, WeightState.RESIDENT):
            return 0.0
        if s == WeightState.STAGED:  # the slot's device-to-device copy (a model's own arrays: none)
            return self.cost.d2d_weights_s(shape) if self.slot is not None else 0.0
        return self.cost.weight_load_s(shape)  # staging in progress: at most a whole load

    # --- InstanceAPI: KV pages --------------------------------------------------------------
    def pages_for(self, model: str, tokens: int) -> int:
        return math.ceil(tokens / self.served[model].engine.page_size)

    def kv_pages_total(self) -> int:
        return self.arena.num_pages

    def kv_pages_used(self) -> int:
        calls = [*self._calls.values(), *self._pending]
        return sum(self.pages_for(c.model, c.context_after) for c in calls)

    def _in_use(self) -> set[tuple[str, str]]:
        """(session, model) of the calls admitted here and not finished: their KV is in use."""
        return {(c.session, c.model) for c in (*self._calls.values(), *self._pending)}

    def kv_pages_reserved(self, exclude_session: str | None = None) -> int:
        busy = self._in_use()
        return sum(self.pages_for(model, self._device_tokens(sid, model)) for sid, model in self.kv.protected()
                   if sid != exclude_session and (sid, model) not in busy)

    def _device_bytes(self) -> float:
        """Weights on the devices (the slot, and its staging area when it holds a model; the models a budget
        holds there, staging included; or every resident model), plus the KV pages in use."""
        weights = self.weights.device_bytes() if self.weights is not None else \
            self._weight_bytes(staged=self._staged is not None)
        return weights + self.kv_pages_used() * self.page_bytes

    def _weight_bytes(self, staged: bool) -> int:
        """The most the weights may take on the devices (`staged`: with the slot's staging area)."""
        if self.weights is not None:
            return self.weights.budget_bytes
        if self.slot is None:
            return self._resident_bytes
        return self.slot.bytes_per_device * self.slot.mesh.devices.size * (2 if staged else 1)

    def _device_tokens(self, session: str, model: str) -> int:
        return self.kv.device_tokens(model, self.tokens.tenant(session), self.tokens.context(session, model))

    def cached_prefix(self, session_id: str, model: str) -> PrefixLocation:
        if model not in self.served or (session_id, model) in self._in_use():
            return PrefixLocation()
        return PrefixLocation(*self.kv.locate(session_id, model, self.tokens.tenant(session_id),
                                              self.tokens.context(session_id, model)))

    def prefix_of(self, session_id: str, model: str, prompt, cache_salt: str | None) -> PrefixLocation:
        """Tokens of `prompt` (ids) this instance holds for `model`: full pages in the device prefix
        cache under the tenant `cache_salt`, and the session's host copy where `prompt` extends it."""
        if model not in self.served:
            return PrefixLocation()
        kv = self.kv.restorable(session_id, model, prompt)
        return PrefixLocation(self.kv.device_tokens(model, cache_salt, prompt), kv.num_tokens if kv is not None else 0)

    # --- InstanceAPI: queue -----------------------------------------------------------------
    def num_waiting(self) -> int:
        return len(self._pending) + sum(s.engine.num_waiting() for s in self.served.values())

    def num_running(self) -> int:
        return sum(s.engine.num_running() for s in self.served.values())

    def num_paused(self) -> int:
        return len(self.paused())

    def drain_s(self) -> float:
        """Seconds until the active model's running calls end: their longest run of decode steps left
        (each call's max tokens less its output, at most the tokens its context still has room for)
        at the cost model's step time for the batch now."""
        if self._active is None:
            return 0.0
        eng = self.served[self._active].engine
        if not eng.running:
            return 0.0
        steps = max(0, max(min(r.params.max_tokens - len(r.output), eng.context_limit - r.num_tokens)
                           for r in eng.running))
        return self.cost.decode_run_s(self.served[self._active].shape, len(eng.running),
                                      sum(r.num_tokens for r in eng.running), steps)

    def pause_cost_s(self, model: str, pages: int) -> float:
        """Seconds of the two switches a pause for `model` costs: to it, and back to the active model,
        a reload unless both stay on the devices (resident, or both within the weight budget). The
        KV arena is apart from the weights: `pages` (the scheduler checks them free) changes nothing."""
        a, w = self._active, self.weights
        stays = a is None or (w.nbytes(a) + w.nbytes(model) <= w.budget_bytes if w is not None else self.resident)
        back = 0.0 if stays else self.cost.weight_load_s(self.served[a].shape)
        return self.estimate_switch_s(model) + back

    def is_busy(self) -> bool:
        return self.busy_until is not None

    def estimate_service_s(self, call: Call) -> float:
        loc = self.cached_prefix(call.session, call.model)
        cached = min(call.prompt_tokens, max(loc.device_tokens, loc.host_tokens))
        running = list(self._calls.values())
        ctx = sum(c.prompt_tokens for c in running) + call.prompt_tokens
        return self.cost.service_s(self.served[call.model].shape, call.prompt_tokens, call.output_tokens, cached,
                                   len(running) + 1, ctx)

    def estimate_batch_s(self, calls: Sequence[Call]) -> float:
        """Seconds of one model's `calls` run together on their own (`CostModel.batch_s`)."""
        def cached(c: Call) -> int:
            loc = self.cached_prefix(c.session, c.model)
            return min(c.prompt_tokens, max(loc.device_tokens, loc.host_tokens))
        return self.cost.batch_s(self.served[calls[0].model].shape, [(c.prompt_tokens, c.output_tokens, cached(c))
                                                                     for c in calls]) if calls else 0.0

    # --- InstanceAPI: actions (carried out at the next step boundary) -------------------------
    def admit(self, call: Call) -> None:
        if call.model not in self.served:
            raise ValueError(f"instance {self.name} does not host model {call.model!r}")
        self._pending.append(call)

    def _unpend(self, call: Call) -> bool:
        """Drops `call` from the admitted calls not yet handed to an engine; whether it was there."""
        for k, c in enumerate(self._pending):
            if c.key == call.key:
                del self._pending[k]
                return True
        return False

    def abort(self, call: Call) -> bool:
        if self._unpend(call):
            return True
        for rid, c in list(self._calls.items()):
            eng = self.served[c.model].engine
            if c.key == call.key and c.model == self._active and eng.is_waiting(rid):  # (a paused call has output)
                eng.abort(rid)
                del self._calls[rid], self._reusable[rid]
                return True
        return False

    def cancel(self, call: Call) -> RequestOutput | None:
        """Stops `call` wherever it is (admitted, waiting or running), freeing its pages; its partial
        output when its engine had it (None otherwise)."""
        if self._unpend(call):
            return None
        for rid, c in list(self._calls.items()):
            if c.key == call.key:
                del self._calls[rid], self._reusable[rid]
                return self.served[c.model].engine.abort(rid)  # waiting (maybe preempted) or running
        return None

    def forget(self, session_id: str) -> None:
        """Drops what the instance keeps of a session that will not return: its host KV copy and its
        protection, its history. Its device pages stay in the prefix cache (protected until the
        deadline given last), evicted as any others."""
        self.kv.forget(session_id)
        self.tokens.forget(session_id)

    def switch_model(self, model: str, pause: bool = False) -> None:
        """Loads `model` at the next chunk; refused while the active model has calls in flight, unless
        `pause`: then they are paused, their engine not stepped until their model is
        active again, their KV kept on device (or in host memory: `release_paused`), and they go on
        as if uninterrupted. Calls admitted but not yet started must start first, and a sleep-mode
        instance (`drop_kv_on_switch`) pauses none. `num_running` counts paused calls, `num_paused`
        them alone (``PolicyConfig.preempt``: when the scheduler pauses)."""
        if model not in self.served:
            raise ValueError(f"instance {self.name} does not host model {model!r}")
        running = any(c.model == self._active for c in self._calls.values())  # (not those paused before)
        if self._pending or (running and (not pause or self.drop_kv_on_switch)):
            why = ("admitted but not started" if self._pending else "in flight (sleep mode)" if pause else
                   "in flight (pause=True pauses them)")
            raise RuntimeError(f"instance {self.name}: switch to {model} with calls {why}")
        self.stats.pauses += int(running)
        self._switch_to = model

    def paused(self) -> list[Call]:
        """Calls in flight of models other than the active one (`switch_model` paused them)."""
        return [c for c in self._calls.values() if c.model != self._active]

    def release_paused(self, model: str, to_host: bool = True) -> int:
        """Frees the device pages of `model`'s paused calls (`Engine.preempt_running`): their KV stays
        cached on device until pages run short, and with `to_host` it is also copied to host memory, to be
        restored when they resume (else recomputed). Nothing of their output is lost. The calls
        released."""
        if model == self._active:
            raise RuntimeError(f"instance {self.name}: {model} is active; only a paused model's calls are released")
        return len(self.served[model].engine.preempt_running(to_host and self.kv.use_host))

    def stage_model(self, model: str) -> bool:
        """Asks for `model`'s weights to be copied into the staging area at the next step boundary
        (one staging area: False while it holds another model, or without staging)."""
        if not self.staging or model not in self.served:
            return False
        if self.weights is not None:  # models in arrays of their own, under a budget
            w = self.weights
            if w.on_device(model) or model in (self._active, w.staging, self._stage_to):
                return True
            if w.staging is not None or self._stage_to is not None or not w.fits(model, keep=self._active):
                return False
        elif self.resident or model in (self._active, self._staged, self._stage_to):
            return True
        elif self._staged is not None or self._stage_to is not None:
            return False
        self._stage_to = model
        return True

    def protect_kv(self, session_id: str, until_s: float) -> None:
        model = self.kv.model_of(session_id)
        context = self.tokens.context(session_id, model) if model is not None else ()
        self.kv.protect(session_id, until_s, self.tokens.tenant(session_id), context)

    # --- chunks -----------------------------------------------------------------------------

    def start_chunk(self, now: float, horizon: float | None = None) -> float | None:
        """Carries out the recorded actions, then runs the next chunk (a switch or one engine step)
        and returns when it ends on the replay's clock (now + measured seconds); None when idle."""
        assert self.busy_until is None, "start_chunk while busy"
        self.now = now
        self.kv.expire()
        if self._stage_to in (self._active, self._switch_to):
            self._stage_to = None  # a switch asked for in the same plan loads it anyway
        if self._stage_to is not None and self._switch_to is None:
            if self.weights is not None:
                self.weights.stage(self._stage_to, keep=self._active)
            else:
                self.slot.stage(self.served[self._stage_to].host)
                self._staged = self._stage_to
            self._stage_to = None
        if self._switch_to is not None:
            model, self._switch_to = self._switch_to, None
            _, dur = self._timed(self._switch, model)
            self.stats.switches += 1
            self.stats.switch_s += dur
            self.stats.switch_log.append((now, model, dur))
            return self._busy(Switch(model), dur)
        if self._pending:
            self._submit()
        eng = self.served[self._active].engine if self._active else None
        if eng is None or not eng.has_unfinished():
            return None
        report, dur = self._timed(eng.run_step)
        outs = report.outputs
        st = self.stats
        st.restored_tokens += report.restored_tokens
        st.device_hit_tokens += report.prefix_hit_tokens
        st.prefill_tokens += report.prefill_tokens
        st.peak_kv_pages = max(st.peak_kv_pages, self.kv_pages_used())
        st.peak_device_bytes = max(st.peak_device_bytes, self._device_bytes())
        return self._busy(Step(tuple(outs)), dur)

    def _timed(self, fn: Callable, *args):
        """fn(*args) and the seconds it took: on the wall clock, less the compiling inside it when
        `exclude_compiles` (added to `stats.compile_s`)."""
        t0, c0 = time.perf_counter(), compile_seconds() if self.exclude_compiles else 0.0
        out = fn(*args)
        seconds = time.perf_counter() - t0
        if self.exclude_compiles:
            compiled = compile_seconds() - c0
            self.stats.compile_s += compiled
            seconds = max(0.0, seconds - compiled)
        return out, seconds

    def _busy(self, chunk: Switch | Step, seconds: float) -> float:
        self.chunk = chunk
        self.busy_until = self.now + seconds
        return self.busy_until

    def _switch(self, model: str) -> None:
        old = self._active
        if old is not None and self.drop_kv_on_switch:  # sleep mode level 1 discards the KV cache
            self.kv.drop_device(old)
        if self.weights is not None:
            self.weights.load(model)
        if self.slot is not None:
            if self._staged == model:
                self.slot.activate_staged()
            else:
                self.slot.drop_staged()  # one staging area: whatever it held is dropped at a switch
                self.slot.load(self.served[model].host)
            self.slot.array.block_until_ready()
        self._staged = None
        self._active = model

    def _submit(self) -> None:
        """Hands the admitted calls to the active engine: each prompt from its session's history, and
        the session's host copy, which tops up what the device cache holds. Callers check calls before
        admitting them (``Engine.check_request``; a replayed call is checked here, its one check): a
        call the engine refused here would fail the step."""
        while self._pending:
            call = self._pending.pop(0)
            if call.model != self._active:
                raise RuntimeError(f"instance {self.name}: call {call.key} for {call.model} admitted while "
                                   f"{self._active} is active")
            s = self.served[call.model]
            eng = s.engine
            request = self.tokens.request(call, eng)
            # at admission the engine takes the device cache's full pages and restores only the rest
            kv = self.kv.restorable(call.session, call.model, request.prompt)
            rid = eng.add_request(request, None, call.id,
                                  keep_kv=self.kv.use_host and self.tokens.returns(call.session),
                                  restore=kv, cache_salt=self.tokens.tenant(call.session), session=call.session)
            self._calls[rid] = call
            # tokens an earlier call computed KV for: all of the history but its last token, up to the
            # prefix a compacting call keeps
            self._reusable[rid] = min(call.max_prefix_tokens, max(0, len(self.tokens.context(call.session, call.model)) - 1))
            self.kv.started(call.session, call.model)

    def finish_chunk(self, now: float) -> list[Call]:
        """Applies the chunk that ends at `now`; returns the calls that completed."""
        assert self.busy_until is not None and abs(now - self.busy_until) < 1e-9, "finish_chunk at wrong time"
        self.now, self.busy_until = now, None
        chunk, self.chunk = self.chunk, None
        if isinstance(chunk, Switch):
            self.step_outputs = []
            return []
        outs = chunk.outputs
        self.step_outputs = [(self._calls[out.request_id], out) for out in outs if out.request_id in self._calls]
        return [self._finished(out) for out in outs if out.finished]

    def _finished(self, out: RequestOutput) -> Call:
        call = self._calls.pop(out.request_id)
        self.stats.recomputed_tokens += max(0, self._reusable.pop(out.request_id) - out.cached_tokens)
        self.outputs[call.key] = out
        self.tokens.finished(call, out.prompt_token_ids, out.token_ids)
        if out.kv is not None:
            self.kv.kept(call.session, call.model, self.tokens.tenant(call.session), out.kv)
        return call


def shapes_of(models: Mapping[str, ShardedModel], tp: int) -> dict[str, ModelShape]:
    """The cost model's shape of each loaded model, at its served precision and the instance's TP."""
    return {n: ModelShape.from_config(m.cfg, m.cfg.weight_dtype, tp, name=n) for n, m in models.items()}


WEIGHT_BUDGETS = ("all", "largest")  # the named weight budgets (`weight_budget_bytes`); else a number of bytes


def check_weight_budget(budget: str | None) -> None:
    """ValueError unless `budget` is None, one of WEIGHT_BUDGETS or a number of bytes >= 1."""
    if budget is not None and budget not in WEIGHT_BUDGETS and not (str(budget).isdigit() and int(budget) >= 1):
        raise ValueError(f"weight budget must be one of {list(WEIGHT_BUDGETS)} or a number of bytes >= 1, "
                         f"got {budget!r}")


def resolve_weight_budget(budget: str | None, models: Mapping[str, ShardedModel]) -> int | None:
    """The device bytes an instance's models' weights may take, over all its devices: None for "all" (or
    None: every model stays on the devices), the largest model's for "largest" (one model of that size at
    a time, smaller ones beside each other), or a number of bytes; None too where the bytes hold every
    model at once (one model, for one): nothing is ever evicted, so no host copy is kept."""
    check_weight_budget(budget)
    if budget is None or budget == "all":
        return None
    held = [held_bytes(m) for m in models.values()]
    limit = max(held) if budget == "largest" else int(budget)
    return None if limit >= sum(held) else limit


def build_instances(names: Sequence[str] | Mapping[str, str], hw: HardwareConfig, *, instances: int = 2,
                    devices_per_instance: int = 1, engine_config: EngineConfig, tokens: SessionTokens | None,
                    seed: int = 0, kv_bytes_per_device: int | None = LOCAL_KV_BYTES, dtype: str | None = None,
                    weight_budget: str | None = None, **instance_kw) -> list[Instance]:
    """`instances` real instances on disjoint devices, each hosting every model of `names` (what
    ``weights.load_model`` loads: a named model, a checkpoint, or a configs/models/ config with random
    weights from `seed`; or a mapping of served names to those) on one KV arena of
    `kv_bytes_per_device` per device (None: as engine_config says). `tokens`: the replay's token
    source, shared by all; None: live serving (each instance its own `LiveTokens`). `weight_budget`:
    models in arrays of their own (`resident`) taking turns under `resolve_weight_budget(weight_budget)`;
    "slot" or None: as `instance_kw` says (a weight slot the models share unless resident)."""
    if instances < 1 or devices_per_instance < 1:
        raise ValueError(f"instances={instances} and devices_per_instance={devices_per_instance} must be >= 1")
    need = instances * devices_per_instance
    if need > len(jax.devices()):
        raise ValueError(f"{instances} instances x {devices_per_instance} devices need {need} devices; "
                         f"{len(jax.devices())} are visible")
    out = []
    for k in range(instances):
        mesh = make_mesh(jax.devices()[k * devices_per_instance:(k + 1) * devices_per_instance])
        sources = names if isinstance(names, Mapping) else {n: n for n in names}
        loaded = {n: load_model(src, mesh=mesh, seed=seed, dtype=dtype) for n, src in sources.items()}
        models = {n: lm.model for n, lm in loaded.items()}
        if weight_budget not in (None, "slot"):
            instance_kw.update(resident=True, weight_budget_bytes=resolve_weight_budget(weight_budget, models))
        out.append(Instance(f"i{k}", models, hw, shapes_of(models, devices_per_instance), engine_config=engine_config,
                            tokens=tokens if tokens is not None else LiveTokens(),
                            kv_bytes_per_device=kv_bytes_per_device,
                            tokenizers={n: lm.tokenizer for n, lm in loaded.items()}, **instance_kw))
    return out
