"""Named scheduling policies: each mechanism is a switch in one frozen ``PolicyConfig``.

`round` is the paper's baseline: identical to `talaria-round-robin` (talaria with round-robin slots)
except that SP, host-KV restoration and D2D staging are off (reservations stay on but, without SP, can only order admissions at slot open). `load`, `sticky` and `composite` are its rivals; on one server
they share the serverless multiplexer (continuous batching, switch on demand with the same slot
quantum, sleep mode that drops device KV); `composite` adds KV-aware routing, a Continuum-style KV
time-to-live and host KV offload.
`talaria` orders slots shortest remaining sessions first (`slot_order="srpt"`,
`Scheduler._srpt_priority`): the model whose sessions are nearest their end per second of slot goes
first, a call aged after all the work left on its instance (undominated in 72 of the regime sweep's
75 cells; docs/traces.md "Regime sweep"). Its variants: `talaria-chain` (the critical chain: Smith's
rule over each model's sessions, a call aged after one round of slots when its sessions' tool gaps
make them the critical chain; up to 18% ahead at p95 with long tool gaps, behind at p50 in most
cells), `talaria-round-robin` (slots in a fixed model order), `talaria-popular-first` (the model
with the most unfinished sessions first, no starvation bound), `talaria-smith` (Smith's rule per
call with a fixed 60 s bound on a call's wait) and `talaria-sp-continuations` (session-prefill of
continuations only, as the paper defines it).
`talaria` also pauses a draining model's calls for another's when that pays (`preempt`,
`Scheduler._pause`); `talaria-no-preempt` is the same policy without pausing.
"""
from __future__ import annotations

import dataclasses

# Tool-gap statistics (docs/references.md "Agent sessions": median 0.3 s, p90 13.6 s, TraceLab).
_TOOL_GAP_P90_S = 13.6
_TOOL_GAP_MEAN_S = 18.4  # docs/references.md: mean 18.4 s (TraceLab)
_TOOL_GAP_P99_S = 216.0  # docs/references.md: p99 3.6 min
# p75 of the lognormal through median 0.3 s and p90 13.6 s: 0.3 * exp(0.674 * ln(13.6/0.3)/1.2816)
_TOOL_GAP_P75_S = 2.2


@dataclasses.dataclass(frozen=True)
class RouterWeights:
    """score = residency * exp(-switch_s / switch_scale_s) + locality * (dev + host_factor * host) / prompt
    - pressure * ((running + waiting + routed) / queue_ref + kv_utilisation)."""

    residency: float = 2.0
    locality: float = 1.0
    host_factor: float = 0.8  # a host restore is cheap next to a recompute, but not free
    pressure: float = 1.0
    switch_scale_s: float = 2.0  # about one full-weight switch of a >100B model over PCIe (sim cost model)
    queue_ref: float = 16.0  # calls at which queueing costs as much as a full KV pool


@dataclasses.dataclass(frozen=True)
class PolicyConfig:
    name: str
    router: str = "talaria"  # talaria | load | sticky | kv
    multiplexer: str = "round"  # round (slots, one model at a time, ordered by slot_order) | on_demand (serverless)
    # round only: which waiting model gets the next slot. round_robin: the next in a fixed order;
    # most_sessions: the one with the most unfinished sessions on the instance (ties in round order),
    # which finishes the popular model's sessions first and the others later; smith: Smith's rule, the
    # most sessions advanced per second of slot (sessions waiting, running or back within the observed
    # p90 tool gap, over the model's observed seconds per call), a slot kept while its model stays
    # first (no drain), and the slot after a call waits max_wait_s given to that call's model; chain:
    # Smith's rule over each model's remaining sessions (sessions per second of the work they have
    # left), the slot kept while its model stays first, and a call aged after all the work left here,
    # or after one round of the other waiting models' slots when its model's sessions need longer,
    # call after call with their tool gaps, than that work (Scheduler._chain_priority); srpt: the sum
    # over each model's sessions of 1 / their calls left, per second of call, a call aged only after
    # all the work left here (Scheduler._srpt_priority)
    slot_order: str = "srpt"
    sp: bool = True  # session-prefill: admit the active model's calls before its slot closes
    # session-prefill admits a new session's first call of the active model too, not only the
    # continuations of its sessions (the paper's definition; docs/scheduler.md "Session-prefill")
    sp_first_calls: bool = True
    host_kv: bool = True  # keep session KV restorable from host memory across switches
    staging: bool = True  # stage the next model into a device staging area; D2D at the switch
    reservations: bool = True  # soft reservations: charge likely returns to the admission budget
    drop_kv_on_switch: bool = False  # sleep-mode level 1: device KV of the outgoing model is discarded
    # round only: once the active model's slot is over, pause its running calls (their KV kept on
    # device) for the next model's waiting calls when that gains their sessions more time than it
    # costs the paused calls' sessions, and resume them right after (Scheduler._pause)
    preempt: bool = True
    kv_ttl_s: float = 0.0  # Continuum-style pin of a finished call's KV (0 = off)
    slot_s: float = 20.0  # longest slot (a quantum for on_demand): ~8 full-weight switches, so switching stays under ~15% of time
    # A slot (round) or quantum (on_demand) lasts switches_per_slot x the switches it amortises (to each
    # other waiting model), within [min_slot_s, slot_s]. 10 keeps switching under ~1/11 of the time
    # until the slot_s cap binds, and every slot before a full PCIe load of a >100B model (2.05-2.73 s
    # on h200x8) at slot_s; free activations of resident models get min_slot_s. None = fixed slot_s.
    # A round slot is bounded once, by the models waiting when the first one starts to wait.
    switches_per_slot: float | None = 10.0
    min_slot_s: float = _TOOL_GAP_P75_S  # a slot still covers a likely tool gap, so SP serves the return
    reserve_horizon_s: float = _TOOL_GAP_P90_S  # a reservation lapses after the p90 tool gap
    reserve_growth_tokens: int = 1000  # expected observation + output appended per turn (docs/references.md: 0.5-1K median obs)
    hold_s: float = _TOOL_GAP_P75_S  # hold a drained slot this long for a reserved session's return
    # smith only: a call that has waited this long makes its model first in slot order (oldest
    # first). Starvation bound: it is admitted within max_wait_s + what is left of the open slot
    # (at most slot_s) + the active model's drain + a switch.
    max_wait_s: float = 60.0
    # chain only: the prior of the mean tool gap, counted as one gap among those observed (calls per
    # session have no prior: scheduler.estimates.SessionLengths)
    tool_gap_mean_s: float = _TOOL_GAP_MEAN_S
    tool_gap_max_s: float = _TOOL_GAP_P99_S  # an open gap longer than this counts as closed at it (its session ended)
    # chain and srpt only: the p50/p95 knob. A waiting call ages (its model goes first, oldest call
    # first) after patience x its order's bound. 0: every call ages at once, so slots go oldest call
    # first, as round-robin would (the p95 end); larger: Smith's rule decides longer, the shortest
    # remaining sessions first (the p50 end); inf: never aged, no starvation bound. 1 is the order
    # as described above (docs/scheduler.md "The p50/p95 knob").
    patience: float = 1.0
    weights: RouterWeights = dataclasses.field(default_factory=RouterWeights)

    def __post_init__(self):
        if self.router not in ("talaria", "load", "sticky", "kv"):
            raise ValueError(f"policy {self.name}: router={self.router!r} not in talaria|load|sticky|kv")
        if self.slot_order not in ("round_robin", "most_sessions", "smith", "chain", "srpt"):
            raise ValueError(f"policy {self.name}: slot_order={self.slot_order!r} not in "
                             f"round_robin|most_sessions|smith|chain|srpt")
        if self.multiplexer not in ("round", "on_demand"):
            raise ValueError(f"policy {self.name}: multiplexer={self.multiplexer!r} not in round|on_demand")
        if self.preempt and self.drop_kv_on_switch and self.multiplexer == "round":
            raise ValueError(f"policy {self.name}: preempt=True pauses calls with their KV on device, which "
                             f"drop_kv_on_switch=True discards at every switch")
        if self.slot_s <= 0:
            raise ValueError(f"policy {self.name}: slot_s={self.slot_s} must be > 0")
        if self.switches_per_slot is not None and self.switches_per_slot <= 0:
            raise ValueError(f"policy {self.name}: switches_per_slot={self.switches_per_slot} must be > 0 or None")
        if not self.patience >= 0:
            raise ValueError(f"policy {self.name}: patience={self.patience} must be >= 0 (inf: never aged)")
        if self.switches_per_slot is not None and not 0 <= self.min_slot_s <= self.slot_s:
            raise ValueError(f"policy {self.name}: min_slot_s={self.min_slot_s} must be in [0, slot_s={self.slot_s}]")


# Each rival gets the quantum rule that serves it best (measured on the three traces): load and sticky
# drop KV at every switch, so a switch-bounded quantum multiplies their recomputes (co-resident p50
# 395 s -> 632 s) and they keep the fixed quantum; composite restores KV from host and gains from it.
_SERVERLESS = dict(multiplexer="on_demand", sp=False, host_kv=False, staging=False, reservations=False,
                   drop_kv_on_switch=True, switches_per_slot=None, preempt=False)

POLICIES: dict[str, PolicyConfig] = {
    "talaria": PolicyConfig("talaria"),
    "round": PolicyConfig("round", slot_order="round_robin", sp=False, host_kv=False, staging=False, preempt=False),
    "load": PolicyConfig("load", router="load", **_SERVERLESS),
    "sticky": PolicyConfig("sticky", router="sticky", **_SERVERLESS),
    "composite": PolicyConfig("composite", router="kv", **{**_SERVERLESS, "host_kv": True, "switches_per_slot": 10.0},
                              kv_ttl_s=_TOOL_GAP_P90_S),
    # ablations: talaria minus one mechanism
    "talaria-no-sp": PolicyConfig("talaria-no-sp", sp=False),
    "talaria-no-hostkv": PolicyConfig("talaria-no-hostkv", host_kv=False),
    "talaria-no-staging": PolicyConfig("talaria-no-staging", staging=False),
    "talaria-no-reservations": PolicyConfig("talaria-no-reservations", reservations=False),
    "talaria-no-preempt": PolicyConfig("talaria-no-preempt", preempt=False),
    # a variant, not the default: slots go to the model with the most unfinished sessions, 60 s long
    # (docs/traces.md: behind the default at p50 at every tool-gap scale, ahead at p95 with tool time)
    "talaria-popular-first": PolicyConfig("talaria-popular-first", slot_order="most_sessions", slot_s=60.0,
                                          switches_per_slot=None),
    # a variant, not the default: Smith's rule with observed tool gaps and a 60 s bound on a call's wait
    # (docs/traces.md: behind the default at p50 at every tool-gap scale, ahead at p95 with tool time)
    "talaria-smith": PolicyConfig("talaria-smith", slot_order="smith"),
    # a variant, not the default: slots in a fixed round-robin model order
    "talaria-round-robin": PolicyConfig("talaria-round-robin", slot_order="round_robin"),
    # a variant, not the default: the critical-chain order (docs/traces.md: ahead of the default at
    # p95 with long tool gaps, behind it at p50 in most cells)
    "talaria-chain": PolicyConfig("talaria-chain", slot_order="chain"),
    # a variant, not the default: session-prefill admits only continuations, as the paper defines it
    # (docs/scheduler.md "Session-prefill")
    "talaria-sp-continuations": PolicyConfig("talaria-sp-continuations", sp_first_calls=False),
}

DEFAULT_POLICIES = ("talaria", "round", "load", "sticky", "composite", "talaria-no-sp", "talaria-no-hostkv",
                    "talaria-no-staging", "talaria-no-reservations", "talaria-no-preempt", "talaria-chain",
                    "talaria-round-robin")


def get_policy(name: str) -> PolicyConfig:
    """Returns a named policy, or one with numeric fields changed: `talaria[patience=0.5]`,
    `talaria[patience=inf;slot_s=30]`. Raises ValueError for an unknown name (listing the known
    ones), an unknown or non-numeric field, or a value out of its range."""
    base, bracket, rest = name.partition("[")
    if base not in POLICIES:
        raise ValueError(f"unknown policy {base!r}; known: {', '.join(POLICIES)}")
    if not bracket:
        return POLICIES[base]
    if not rest.endswith("]"):
        raise ValueError(f"policy {name!r}: write changed fields as {base}[field=number;field=number]")
    types = {f.name: f.type for f in dataclasses.fields(PolicyConfig)}
    numeric = {n for n, t in types.items() if t in ("float", "int", "float | None")}
    changes = {}
    for pair in filter(None, rest[:-1].split(";")):
        field, _, value = (x.strip() for x in pair.partition("="))
        if field not in numeric:
            raise ValueError(f"policy {name!r}: {field!r} is not a numeric field of PolicyConfig "
                             f"(numeric: {', '.join(sorted(numeric))})")
        try:
            changes[field] = float(value)
        except ValueError:
            raise ValueError(f"policy {name!r}: {field}={value!r} is not a number") from None
        if types[field] == "int":
            if not changes[field].is_integer():
                raise ValueError(f"policy {name!r}: {field}={value!r} must be an integer")
            changes[field] = int(changes[field])
    return dataclasses.replace(POLICIES[base], name=name, **changes)
