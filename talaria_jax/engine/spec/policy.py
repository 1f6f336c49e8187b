"""When to speculate: drafts per sequence from the engine's measured step-cost curve and acceptance.

Verifying k draft tokens per sequence makes a step of B sequences carry B x (1 + k) tokens. While
the step is bound by reading the weights (small batches on a GPU), those extra tokens are nearly
free and each accepted one saves a whole step; as the batch saturates the compute, a step of more
tokens costs proportionally more and speculation stops paying. The policy measures the step cost
at every token bucket at start (plain steps and verifying steps, which compute logits at every
token), keeps a running estimate of the per-token acceptance rate a, and picks the k that
maximises expected tokens per second: B x (1 + a + ... + a^k) / cost_verify(B x (1 + k)) against
B / cost_plain(B) for no speculation. No threshold is a constant: the switch point moves with the
hardware, the model and the workload's acceptance.
"""
from __future__ import annotations


class SpecPolicy:
    """Draft tokens per sequence for a step of `batch` sequences (0: a plain step)."""

    def __init__(self, max_spec_tokens: int, buckets: tuple[int, ...], plain_s: dict[int, float] | None,
                 verify_s: dict[int, float] | None, always: bool = False, prior: tuple[float, float] = (1.0, 1.0)):
        """plain_s, verify_s: seconds per step at each token bucket (None with always=True). prior:
        pseudo-counts (accepted, rejected) of the acceptance estimate before any step."""
        self.max_spec_tokens, self.buckets, self.always = max_spec_tokens, buckets, always
        self.plain_s, self.verify_s = plain_s, verify_s
        self.prior = prior
        self.reset()

    def reset(self) -> None:
        """Forgets the acceptance and the step times seen (a new workload); the step-cost curve stays."""
        self.accepted, self.rejected = self.prior
        self.scored, self.scored_accepted = 1.0, 1.0  # drafts' scores (expected accepted) and what was accepted
        self.scale: dict[tuple[bool, int], float] = {}  # (verifying, bucket): real step time over the curve's

    def observe_step(self, verifying: bool, tokens: int, seconds: float) -> None:
        """A real step's time: the curve (all-padding steps) leaves out the attention over the real
        contexts and the query tiles of the drafts, so each kind of step at each bucket keeps a running
        ratio of its real time to the curve's, and gains() scales the curve by it (1 until seen)."""
        curve = (self.verify_s if verifying else self.plain_s)
        t = self._bucket(tokens)
        if curve is None or t is None:
            return
        s = self.scale.get((verifying, t), 1.0)
        self.scale[(verifying, t)] = s + 0.2 * (seconds / curve[t] - s)

    @classmethod
    def measure(cls, runner, spec, reps: int = 3) -> "SpecPolicy":
        """Times the runner's plain and verifying steps at each bucket (`Runner.step_seconds`: best of
        `reps`, all-padding batches: the weights' read and the logits, what a decode step's cost grows
        with)."""
        if spec.policy == "always":
            return cls(spec.max_spec_tokens, runner.buckets, None, None, always=True)
        plain, verify = runner.step_seconds(reps)
        return cls(spec.max_spec_tokens, runner.buckets, plain, verify)

    @property
    def acceptance(self) -> float:
        """Estimated probability that a draft token is accepted given its parent was (the maximum
        likelihood of a geometric run: accepted / (accepted + runs that ended in a rejection))."""
        return self.accepted / (self.accepted + self.rejected)

    def observe(self, drafted: int, accepted: int, score: float = 0.0) -> None:
        """One verified draft: its length, the tokens accepted, and its score (the drafter's expectation)."""
        self.accepted += accepted
        self.rejected += accepted < drafted
        self.scored += score
        self.scored_accepted += accepted

    @property
    def calibration(self) -> float:
        """Tokens accepted per unit of draft score so far (the drafter's frequencies are estimates)."""
        return self.scored_accepted / self.scored

    def worth(self, batch: int, draft_tokens: int, score: float) -> bool:
        """Whether a step of `batch` sequences should verify these drafts (draft_tokens in all, summed
        score): expected tokens per second of the verifying step, (batch + calibrated score) over its
        cost at its real token count, against batch over a plain step's."""
        if self.always:
            return True
        t, b = self._bucket(batch + draft_tokens), self._bucket(batch)
        if t is None:
            return False
        plain = self.plain_s[b] * self.scale.get((False, b), 1.0)
        verify = self.verify_s[t] * self.scale.get((True, t), 1.0)
        return (batch + self.calibration * score) / verify > batch / plain

    def _bucket(self, n: int) -> int | None:
        return next((b for b in self.buckets if n <= b), None)

    def gains(self, batch: int) -> list[float]:
        """Expected tokens per second with k = 0, 1, ... max_spec_tokens drafts per sequence over that
        of plain steps (0 past the largest bucket)."""
        a, b, expected, out = self.acceptance, self._bucket(batch), 1.0, [1.0]
        if b is None:
            return out + [0.0] * self.max_spec_tokens
        plain = self.plain_s[b] * self.scale.get((False, b), 1.0)
        for k in range(1, self.max_spec_tokens + 1):
            expected += a ** k
            t = self._bucket(batch * (1 + k))
            out.append(0.0 if t is None else expected * plain / (self.verify_s[t] * self.scale.get((True, t), 1.0)))
        return out

    def draft_len(self, batch: int) -> int:
        if batch < 1:
            return 0
        if self.always:
            return self.max_spec_tokens
        gains = self.gains(batch)
        return gains.index(max(gains))

