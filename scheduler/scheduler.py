"""The scheduler: routes arriving calls, admits them into instances, and multiplexes models.

It sees instances only through ``InstanceAPI`` and is driven by three callbacks from whatever
runs the instances (the simulator's event loop or the serving loop): ``on_arrival`` when a call is
issued, ``on_finish`` when one completes, and ``plan`` whenever an instance is between steps.
"""
from __future__ import annotations

import dataclasses
from typing import Sequence

from talaria_jax.scheduler import router
from talaria_jax.scheduler.admission import AdmissionBudget, Reservation
from talaria_jax.scheduler.api import InstanceAPI
from talaria_jax.scheduler.estimates import CallTimes, SessionLengths, ToolGaps
from talaria_jax.scheduler.hints import HintBook, within_margin
from talaria_jax.scheduler.multiplexer import RoundMultiplexer
from talaria_jax.scheduler.policies import PolicyConfig
from talaria_jax.scheduler.session import Call, SessionTable


_AGED = 1e12  # a starving model's weight: above any Smith ratio, older waits higher


def _aged(now: float, since: float) -> float:
    """The slot-order weight of a model whose oldest pending call has waited since `since`."""
    return _AGED * (1.0 + now - since)


@dataclasses.dataclass
class _InstanceState:
    mux: RoundMultiplexer
    budget: AdmissionBudget
    pending: list[tuple[float, Call]] = dataclasses.field(default_factory=list)  # routed, not admitted
    # call key -> (call, when admitted), until it finishes
    admitted: dict[tuple[str, int], tuple[Call, float]] = dataclasses.field(default_factory=dict)
    finished: dict[str, float] = dataclasses.field(default_factory=dict)  # session -> when its last call finished here
    switching_to: str | None = None
    pause_s: float | None = None  # a pause's switch is in flight: its slot lasts this long (`_pause`)
    resume: str | None = None  # the model a pause paused: the next slot goes to it
    paused_keys: set = dataclasses.field(default_factory=set)  # calls paused once (not again), until they finish
    quantum_start_s: float = 0.0  # when the on-demand multiplexer's active model started serving


def hold_until(r: Reservation, hold: float) -> float:
    """The time until which a drained slot is held for reservation `r`'s return (`r.start_s`: not held):
    `hold` past its start; with a hinted return (`r.back_s`), until that return with its margin, or not
    at all when it comes after the hold."""
    if r.back_s is None:
        return r.start_s + hold
    if r.back_s > r.start_s + hold:
        return r.start_s
    return min(r.start_s + hold, r.start_s + within_margin(r.back_s - r.start_s))


class Scheduler:
    """One policy over a set of instances (the same code drives simulated and real instances)."""

    def __init__(self, policy: PolicyConfig, instances: Sequence[InstanceAPI], sessions: SessionTable,
                 indexed: bool = False):
        """`indexed`: place calls through a ``router.RouteIndex`` (the same placements, in time that
        grows with the instances changed since the last placement rather than with all of them); only
        for a caller that runs every change to an instance through ``plan`` (see ``RouteIndex``)."""
        self.policy = policy
        self.instances = list(instances)
        self.sessions = sessions
        self.state: dict[str, _InstanceState] = {}
        self.gaps = ToolGaps(policy.reserve_horizon_s, policy.tool_gap_mean_s, policy.tool_gap_max_s)
        self.lengths = SessionLengths()  # calls per session
        self.call_s = CallTimes()  # seconds per call of each model, admission to finish
        self.hints = HintBook()  # the agents' hints, and whether they have held up
        self._reserved_on: dict[str, dict[str, None]] = {}  # session -> instances whose budgets may hold its reservation
        # instances other than the routed one whose state the last on_arrival changed (a released
        # reservation can end a slot hold there): an event loop re-plans them if they are idle
        self.released: list[InstanceAPI] = []
        self._by_name = {inst.name: inst for inst in self.instances}
        for inst in self.instances:
            self.state[inst.name] = _InstanceState(RoundMultiplexer(inst.models(), policy.slot_s, policy.switches_per_slot,
                                                                    policy.min_slot_s),
                                                   AdmissionBudget(policy.reserve_horizon_s))
        self.index = router.RouteIndex(policy, self.instances, lambda n: len(self.state[n].pending)) if indexed else None

    # --- callbacks --------------------------------------------------------------------------
    def on_arrival(self, call: Call, now: float) -> InstanceAPI:
        """Routes a newly issued call to an instance's pending queue; returns that instance."""
        if self.index is not None:
            inst = self.index.best(call, self.sessions[call.session], now)
            self.index.routed_to(call, inst)
        else:
            routed = {n: len(s.pending) for n, s in self.state.items()}
            inst = router.rank(self.policy, call, self.sessions[call.session], self.instances, routed)[0]
        self.released = []
        for held in self._reserved_on.pop(call.session, ()):  # the likely return has happened
            if call.session in self.state[held].budget.reservations:
                self.state[held].budget.release(call.session)
                if held != inst.name:
                    self.released.append(self._by_name[held])
        self.hints.arrived(call, self.gaps.open.get(call.session), now, self.gaps.p90())
        self.gaps.end(call.session, now)
        if not self.sessions[call.session].single:
            self.lengths.issued(call.session, call.turn + 1)
        last = self.sessions[call.session].last_instance
        if last is not None:
            self.state[last].finished.pop(call.session, None)
        self.state[inst.name].pending.append((now, call))
        return inst

    def withdraw(self, call: Call) -> bool:
        """Takes back a call its caller gave up; whether no instance had admitted it yet (else the
        caller cancels it on its instance)."""
        for name, st in self.state.items():
            st.admitted.pop(call.key, None)
            for k, (_, c) in enumerate(st.pending):
                if c.key == call.key:
                    del st.pending[k]
                    if self.index is not None:
                        self.index.touch(self._by_name[name])
                    return True
        return False

    def forget(self, session: str) -> None:
        """Drops what the scheduler keeps about a session that has ended or gone idle for good."""
        if session in self.sessions.sessions and not self.sessions[session].done:
            self._count_ended(session)  # a live session ends by going idle (a done one counted at its end)
        self.lengths.forget(session)
        self.hints.forget(session)
        self.gaps.end(session, 0.0, observe=False)
        self._reserved_on.pop(session, None)
        for st in self.state.values():
            for key in [k for k in st.admitted if k[0] == session]:
                del st.admitted[key]
            st.finished.pop(session, None)
            st.budget.release(session)

    def on_finish(self, call: Call, inst: InstanceAPI, now: float) -> None:
        """Bookkeeping after `call` completed on `inst` (the session table is already advanced)."""
        admitted = self.state[inst.name].admitted.pop(call.key, None)
        if admitted is not None:
            self.call_s.add(call.model, now - admitted[1])
        if self.index is not None:
            self.index.touch(inst)
        self.hints.finished(call, now)
        if self.ends(call):
            self._count_ended(call.session)
            return
        self.gaps.begin(call.session, now)
        self.state[inst.name].finished[call.session] = now
        p = self.policy
        tool_s = self.hints.of(call).tool_s  # a return hinted past twice the p90 horizon gets no reservation
        horizon = p.reserve_horizon_s if tool_s is None else within_margin(tool_s)  # (its KV may go to host)
        if p.reservations and (tool_s is None or tool_s <= 2 * p.reserve_horizon_s):
            pages = inst.pages_for(call.model, call.context_after + p.reserve_growth_tokens)
            self.state[inst.name].budget.reserve(call.session, call.model, pages, now, horizon,
                                                 None if tool_s is None else now + tool_s)
            self._reserved_on.setdefault(call.session, {})[inst.name] = None
            inst.protect_kv(call.session, now + horizon)
        elif p.kv_ttl_s > 0:
            inst.protect_kv(call.session, now + p.kv_ttl_s)

    def plan(self, inst: InstanceAPI, now: float) -> float | None:
        """Admits, stages and switches on an instance that is between steps. Returns a time at
        which to be called again even if nothing else happens (a slot hold ending), or None."""
        st = self.state[inst.name]
        st.budget.expire(now)
        if self.index is not None:
            self.index.touch(inst)  # what the plan and the chunk after it change is read at the next placement
        if self.policy.multiplexer == "round":
            return self._plan_round(inst, st, now)
        return self._plan_on_demand(inst, st, now)

    # --- helpers ----------------------------------------------------------------------------
    def ends(self, call: Call) -> bool:
        """Whether `call` is known to end its session: a call sent without a session, or one whose
        believed hints say no call follows (`Hints.calls_left` 0). Nothing else tells the scheduler:
        a live server, like the simulator, learns of other ends only when a tool gap passes the p99."""
        return self.sessions[call.session].single or self.hints.of(call).calls_left == 0

    def _weight(self, sid: str) -> float:
        """A session's weight in the slot order: 2**priority of its hinted call, else 1."""
        h = self.hints.session(sid)
        return 1.0 if h is None else 2.0 ** h[1].priority

    def _left(self, sid: str) -> float:
        """The calls `sid` has left (at least 1): its hint (`Hints.calls_left` of its latest call,
        less the calls finished since), else the estimate (`SessionLengths.left`)."""
        done = self.sessions[sid].next_turn
        h = self.hints.session(sid)
        if h is not None and h[1].calls_left is not None:
            return max(1.0, float(h[0] + 1 + h[1].calls_left - done))
        return self.lengths.left(done)

    def demand(self, inst: InstanceAPI) -> set[str]:
        """The models that want a slot: those with calls pending here, or paused here."""
        st = self.state[inst.name]
        models = {c.model for _, c in st.pending}
        if inst.num_paused():
            models |= {c.model for c, _ in st.admitted.values() if c.model != inst.active_model()}
        return models

    def slot_priority(self, inst: InstanceAPI, now: float = 0.0) -> dict[str, float] | None:
        """The weight of each model in slot order (``RoundMultiplexer.next_model``); None for round-robin.
        most_sessions: the unfinished sessions this instance knows (a call pending or running here,
        or its last call served here). smith: the sessions pending, running, or whose last call
        finished here within the observed p90 tool gap, over the model's seconds per call; a model
        whose oldest pending call has waited max_wait_s outranks every other (oldest first)."""
        order = self.policy.slot_order
        if order == "round_robin":
            return None
        st = self.state[inst.name]
        if order == "chain":
            return self._chain_priority(inst, st, now)
        if order == "srpt":
            return self._srpt_priority(inst, st, now)
        sids = {c.session for _, c in st.pending} | {k[0] for k in st.admitted}
        if order == "most_sessions":
            sids |= {s.id for s in self.sessions if s.last_instance == inst.name and not s.done}
        else:  # smith: and those likely back soon (their tool gap is within the observed p90)
            horizon = now - self.gaps.p90()
            sids |= {sid for sid, t in st.finished.items() if t >= horizon}
        out: dict[str, float] = {}
        for sid, m in self._models_of(st, sids).items():
            out[m] = out.get(m, 0.0) + self._weight(sid)
        if order == "smith":  # Smith's rule: sessions a model's slot advances per second of it
            out = {m: n / self._call_s(st, inst, m) for m, n in out.items()}
            # aging: a model whose oldest pending call has waited max_wait_s goes first, oldest first
            for t, c in st.pending:
                if now - t >= self.policy.max_wait_s:
                    out[c.model] = max(out.get(c.model, 0.0), _aged(now, t))
        return out

    def _sessions_here(self, st: _InstanceState, now: float) -> tuple[dict[str, str], dict[str, float]]:
        """Each unfinished session on this instance (a call pending or running here, or its last call
        finished here within the stated p99 tool gap) -> its model, and -> the calls it is expected to
        have left (`SessionLengths.left`, at least 1)."""
        for sid in self.gaps.expire(now):  # gone past the p99 gap: ended, unless it comes back
            self.lengths.end(sid, reopen=True)
        model = self._models_of(st, [sid for sid, t in st.finished.items() if now - t <= self.gaps.max_gap_s])
        return model, {sid: self._left(sid) for sid in model}

    def _models_of(self, st: _InstanceState, sids) -> dict[str, str]:
        """`sids` (sessions in their tool gap: the model each used last) and the sessions of the calls
        running or pending here -> the model each is on (a call's own model)."""
        model = {sid: self.sessions[sid].model for sid in sids}
        model.update({c.session: c.model for c, _ in st.admitted.values()})
        model.update({c.session: c.model for _, c in st.pending})
        return model

    def _chain_priority(self, inst: InstanceAPI, st: _InstanceState, now: float) -> dict[str, float]:
        """The "chain" slot order (``PolicyConfig.slot_order``): Smith's rule over each model's
        sessions here, aged by the critical chain. Per model m, from what the scheduler observes:
        its unfinished sessions here (n), the calls its furthest-behind session has left (r: the
        expected calls per session less the calls it has made, at least 1), the seconds a call of
        m takes once admitted (c) and the mean tool gap (g). Its work left is W = r c (its sessions'
        calls run batched), its chain r (g + c) (the time its last session needs at best).
        - weight n / W: the sessions a second of slot brings to their end, so the model whose
          sessions end soonest per second goes first and the slot stays with it (no drain) while it
          ranks first;
        - a call ages after waiting as long as all the work left here (the sum of W), or, when its
          model's chain is at least that work (postponing it would then delay its sessions past
          everything else: their tool gaps, not the server, bound them), as long as one round of
          slots of the other waiting models; then its model goes first, oldest call first. A call
          older than an aged call ages with it when its model's work left fits in one slot (serving
          it delays the aged call no more than the round of slots it already waits): a model of long
          calls, critical and aged after each round, would otherwise keep a model of short calls
          waiting for all of its work."""
        model, left = self._sessions_here(st, now)
        n: dict[str, float] = {}
        rounds: dict[str, float] = {}
        for sid, m in model.items():
            n[m] = n.get(m, 0.0) + self._weight(sid)
            rounds[m] = max(rounds.get(m, 0.0), left[sid])
        call = {m: self._call_s(st, inst, m) for m in n}
        work = {m: rounds[m] * call[m] for m in n}
        total = sum(work.values())
        gap = self.gaps.mean(now)
        oldest = self._oldest_pending(st)
        out = {m: n[m] / work[m] for m in n}
        aged = []
        for m in oldest.keys() & n.keys():
            critical = rounds[m] * (gap + call[m]) >= total
            bound = sum(st.mux.slot_length(inst.estimate_switch_s(o)) for o in oldest if o != m) \
                if critical else total
            if now - oldest[m] >= self.policy.patience * bound:
                aged.append(m)
        for m in aged:
            out[m] = _aged(now, oldest[m])
        if aged:  # a call older than an aged one whose model's work left fits in one slot ages with it
            youngest = max(oldest[m] for m in aged)
            for m in oldest.keys() & n.keys():
                if oldest[m] <= youngest and work[m] <= st.mux.slot_length(inst.estimate_switch_s(m)):
                    out[m] = _aged(now, oldest[m])
        return out

    def _srpt_priority(self, inst: InstanceAPI, st: _InstanceState, now: float) -> dict[str, float]:
        """The "srpt" slot order (``PolicyConfig.slot_order``): shortest remaining sessions first.
        A model's weight is the sum over its unfinished sessions here of 1 / (the calls that session
        has left), per second of one of its calls (c, as in "chain"): a slot that serves one call of
        each session advances every session by 1 / its calls left, so the model whose sessions are
        nearest their end per second of slot goes first (Smith's rule per session rather than per
        model). The only aging is chain's bound without the critical-chain rule: a call ages after
        waiting as long as all the work left here (per model, its furthest-behind session's calls
        left x c, summed), so a call is admitted within that bound plus the open slot, a drain and
        a switch, as under "chain" with short tool gaps."""
        model, left = self._sessions_here(st, now)
        weight: dict[str, float] = {}
        rounds: dict[str, float] = {}
        for sid, m in model.items():
            weight[m] = weight.get(m, 0.0) + self._weight(sid) / left[sid]
            rounds[m] = max(rounds.get(m, 0.0), left[sid])
        call = {m: self._call_s(st, inst, m) for m in weight}
        total = sum(rounds[m] * call[m] for m in weight)
        out = {m: w / call[m] for m, w in weight.items()}
        for m, t in self._oldest_pending(st).items():
            if now - t >= self.policy.patience * total:
                out[m] = _aged(now, t)
        return out

    @staticmethod
    def _oldest_pending(st: _InstanceState) -> dict[str, float]:
        """Per model, when its oldest pending call here was routed."""
        oldest: dict[str, float] = {}
        for t, c in st.pending:
            oldest[c.model] = min(oldest.get(c.model, t), t)
        return oldest

    def _count_ended(self, session: str) -> None:
        """Counts an ended session's calls in `lengths` (a call sent without a session is not one);
        a session that said it ended and calls again is taken back (`SessionLengths.issued`)."""
        self.lengths.end(session, self.sessions[session].next_turn, reopen=True)

    def _call_s(self, st: _InstanceState, inst: InstanceAPI, model: str) -> float:
        """Seconds a call of `model` takes once admitted: the observed median (`CallTimes`), else the
        instance's estimate for one of its pending (else running) calls."""
        seen = self.call_s.get(model)
        if seen is not None:
            return max(seen, 1e-3)
        c = next((c for _, c in st.pending if c.model == model), None) or \
            next((c for c, _ in st.admitted.values() if c.model == model), None)
        return max(inst.estimate_service_s(c), 1e-3) if c is not None else 1.0

    def _keeps_slot(self, inst: InstanceAPI, st: _InstanceState, model: str, now: float) -> bool:
        """Under a priority slot order: whether the active `model` still ranks strictly first."""
        prio = self.slot_priority(inst, now)
        if not prio:
            return False
        return st.mux.next_model(self.demand(inst) | {model}, prio) == model

    def _admit(self, inst: InstanceAPI, st: _InstanceState, model: str, now: float,
               continuations_only: bool = False) -> int:
        """Admits pending calls of `model` while they fit, the highest `Hints.priority` first, then in
        arrival order; returns how many."""
        keep, n = [], 0
        for t, c in sorted(st.pending, key=lambda tc: -tc[1].hints.priority):
            ok = c.model == model and (c.is_continuation or not continuations_only)
            if ok:
                pages = inst.pages_for(c.model, c.context_after)
                if self.policy.reservations:
                    ok = st.budget.fits(inst, c.session, pages, now)
                else:  # physical room only: pages not held by admitted calls
                    ok = inst.num_running() + inst.num_waiting() == 0 or \
                        pages <= inst.kv_pages_total() - inst.kv_pages_used()
            if ok:
                inst.admit(c)
                st.admitted[c.key] = (c, now)
                n += 1
            else:
                keep.append((t, c))
        st.pending = keep
        return n

    def _bound_slot(self, inst: InstanceAPI, st: _InstanceState, model: str) -> None:
        """Once another model waits: bounds `model`'s open slot by the switches of the round it
        starts (to each other model waiting then, estimated before any staging starts)."""
        others = self.demand(inst) - {model}
        if others:
            st.mux.bound(sum(inst.estimate_switch_s(m) for m in others))

    def _stage_next(self, inst: InstanceAPI, st: _InstanceState, model: str, now: float) -> None:
        """Stages the model whose slot follows `model`'s (when staging is on): after a pause's slot,
        the paused model."""
        nxt = st.resume or st.mux.after(model, self.demand(inst), self.slot_priority(inst, now))
        if nxt is not None and self.policy.staging:
            inst.stage_model(nxt)

    def _open_slot(self, inst: InstanceAPI, st: _InstanceState, model: str, now: float) -> None:
        st.mux.open(model, now)
        self._bound_slot(inst, st, model)
        self._admit(inst, st, model, now)
        self._stage_next(inst, st, model, now)

    def _switch(self, inst: InstanceAPI, st: _InstanceState, model: str, now: float) -> None:
        inst.switch_model(model)
        st.switching_to = model

    # --- round-based multiplexing (talaria, round and the talaria ablations) ----------------
    def _plan_round(self, inst: InstanceAPI, st: _InstanceState, now: float) -> float | None:
        p, mux = self.policy, st.mux
        if st.switching_to is not None:  # the switch issued earlier has completed
            model, st.switching_to = st.switching_to, None
            self._open_slot(inst, st, model, now)
            if st.pause_s is not None:  # a pause's slot: its waiting calls' work, then back
                mux.slot.deadline_s, mux.slot.bounded = min(mux.slot.deadline_s, now + st.pause_s), True
                st.pause_s = None
            elif model == st.resume:  # the paused calls resume: their slot had ended, so they drain
                if inst.num_running() - inst.num_paused():  # (unless they were all cancelled)
                    mux.slot.deadline_s, mux.slot.bounded = now, True
                st.resume = None
        if st.resume is not None and st.resume not in self.demand(inst):
            st.resume = None  # its paused calls were cancelled: nothing to go back to
        pausing = st.resume is not None  # a pause's slot: not renewed, no session-prefill, not held, then back
        slot = mux.slot
        if slot is not None:
            m = slot.model
            self._bound_slot(inst, st, m)  # before SP, so SP never admits past the bounded deadline
            if now >= slot.deadline_s and not pausing and self._keeps_slot(inst, st, m, now):
                self._open_slot(inst, st, m, now)  # still first in slot order: a fresh slot, no drain
                slot = mux.slot
            if p.sp and now < slot.deadline_s and not pausing:
                self._admit(inst, st, m, now, continuations_only=not p.sp_first_calls)  # session-prefill
            self._stage_next(inst, st, m, now)
            if inst.num_running() - inst.num_paused() or inst.num_waiting():
                if p.preempt and now >= slot.deadline_s and not pausing:
                    self._pause(inst, st, m, now)
                return None
            demand = self.demand(inst)
            if not demand - {m}:
                # nobody else waits: a fresh slot for the same model costs nothing
                if m in demand:
                    self._open_slot(inst, st, m, now)
                return None
            if p.reservations and p.sp and now < slot.deadline_s and not pausing:
                # keep the slot for a reserved session's likely return, but (ski rental) never longer
                # than switching away and back would cost
                nxt = st.mux.after(m, demand, self.slot_priority(inst, now))
                hold = min(p.hold_s, 2.0 * inst.estimate_switch_s(nxt)) if nxt is not None else p.hold_s
                holds = [hold_until(r, hold) for r in st.budget.live_for(m, now)]
                until = min(max(holds, default=now), slot.deadline_s)
                if until > now:
                    return until
            mux.close()
        nxt = st.resume or mux.next_model(self.demand(inst), self.slot_priority(inst, now))
        if nxt is None:
            return None
        if inst.active_model() == nxt:
            self._open_slot(inst, st, nxt, now)  # an idle instance admits at least the first call
            return None
        self._switch(inst, st, nxt, now)
        return None

    def _pause(self, inst: InstanceAPI, st: _InstanceState, model: str, now: float) -> bool:
        """Pauses `model`'s running calls (their slot over) for the model next in slot order, when that
        pays (``PolicyConfig.preempt``); whether it did. Without the pause, the next model's waiting
        calls wait for the running ones to drain (`drain_s`: from each call's tokens left, its
        `max_tokens` less its output, so a live client's generous cap makes the drain look longer);
        with it, the running calls wait for the two switches (`pause_cost_s`) and the waiting calls'
        work (`estimate_batch_s`: one prefill of them all, then their decode as one batch; it also
        bounds the pause's slot). A paused call's delay moves its session's end by as much; a
        waiting call's gain moves its session's end by as much only if no later call of the session
        waits again, so it counts once over the calls its session has left (`_left`, as the "srpt"
        order weighs sessions). Each session weighted as in the slot order (2**priority of its
        hinted call), the pause pays when
        sum_waiting w / left * drain > sum_running w * (switches + work):
        the short sessions' calls go past the long ones' (shortest remaining first).
        The pause's slot admits no session-prefill, is not renewed and holds nothing for returns:
        the paused calls resume right after, and a call once paused is not paused again, so a call
        is delayed by one pause at most. Only one pause at a time; only for calls that fit the
        admission budget beside the paused KV (nothing moves to host for a pause); only once the
        active model's admitted calls have all started (sleep mode, which drops KV at a switch, is
        refused with `preempt` by ``PolicyConfig``)."""
        if inst.num_paused() or inst.num_waiting():
            return False
        running = [c for c, _ in st.admitted.values() if c.model == model]
        st.paused_keys &= st.admitted.keys()
        if not running or any(c.key in st.paused_keys for c in running):
            return False
        nxt = st.mux.after(model, self.demand(inst), self.slot_priority(inst, now))
        waiting = [c for _, c in st.pending if c.model == nxt]
        if not waiting:
            return False
        pages = sum(inst.pages_for(c.model, c.context_after) for c in waiting)
        if pages > inst.kv_pages_free() or \
                (self.policy.reservations and not st.budget.fits(inst, waiting[0].session, pages, now)):
            return False
        work = inst.estimate_batch_s(waiting)
        gain = sum(self._weight(c.session) / self._left(c.session) for c in waiting) * inst.drain_s()
        loss = sum(self._weight(c.session) for c in running) * (inst.pause_cost_s(nxt, pages) + work)
        if not gain > loss:
            return False
        st.mux.close()
        inst.switch_model(nxt, pause=True)
        st.switching_to, st.pause_s, st.resume = nxt, work, model
        st.paused_keys |= {c.key for c in running}
        return True

    # --- serverless on-demand multiplexing (load, sticky, composite) ------------------------
    def _plan_on_demand(self, inst: InstanceAPI, st: _InstanceState, now: float) -> float | None:
        if st.switching_to is not None:
            st.switching_to = None
            st.quantum_start_s = now
        active = inst.active_model()
        demand = self.demand(inst)
        others = demand - {active}
        # The quantum follows the switch it amortises, as the round multiplexer's slot does.
        quantum = st.mux.slot_length(sum(inst.estimate_switch_s(m) for m in others)) if others else 0.0
        quantum_over = bool(others) and now - st.quantum_start_s >= quantum
        if active is not None and not quantum_over:
            self._admit(inst, st, active, now)
        if inst.num_running() or inst.num_waiting() or not others:
            return None
        if active in self.demand(inst) and not quantum_over:
            return None  # the active model still has admissible work next step
        oldest = min((t, k, c) for k, (t, c) in enumerate(st.pending) if c.model != active)[2]
        self._switch(inst, st, oldest.model, now)
        return None
