"""The process's memory maps against the kernel's limit (Linux `vm.max_map_count`).

XLA:CPU maps about three regions (code, read-only data, data) per compiled kernel, and an unrolled
decoder's step program has a few hundred kernels: one SmolLM2-135M instance's step programs take
about 13,400 maps as whole-step programs, about 4,700 as layer programs
(`EngineConfig.layers_per_program`). Past the limit, LLVM fails to allocate ("Cannot allocate memory") and the process
dies. `MapBudget` projects what the programs still to compile will take from what those compiled so
far took, and raises `MapLimitError`, a clear error, before the limit is reached.
"""
from __future__ import annotations

__all__ = ["MapBudget", "MapLimitError", "map_count", "map_limit"]

SHARE = 0.9  # of the limit: what the projection may reach (other code maps memory too)


class MapLimitError(RuntimeError):
    """Compiling the programs still to come would pass the process's memory-map limit."""


def map_count(pid: int | str = "self") -> int | None:
    """Memory maps process `pid` (default: this one) holds now (None where /proc cannot tell)."""
    try:
        with open(f"/proc/{pid}/maps", "rb") as f:
            return sum(1 for _ in f)
    except OSError:
        return None


def map_limit() -> int | None:
    """The kernel's limit on a process's memory maps (None where /proc cannot tell)."""
    try:
        with open("/proc/sys/vm/max_map_count") as f:
            return int(f.read())
    except (OSError, ValueError):
        return None


class MapBudget:
    """Checks, before each of `total` programs compiles, that the maps the programs left would take
    stay within SHARE of the limit, at the rate of those compiled since the first (the first also maps
    what a process's first compilation sets up once). `what` names the programs in the error."""

    def __init__(self, total: int, what: str):
        self.total, self.what, self.done = total, what, 0
        self.limit = map_limit()
        self.after_first: int | None = None

    def check(self) -> None:
        """Call before compiling the next program; then `compiled()` after it."""
        now = map_count()
        if self.limit is None or now is None or self.after_first is None or self.done < 2:
            return
        per = max(0.0, (now - self.after_first) / (self.done - 1))
        left = self.total - self.done
        if now + per * left > SHARE * self.limit:
            raise MapLimitError(
                f"compiling {self.what}: this process holds {now} memory maps, and the {left} programs left would "
                f"take about {per * left:.0f} more ({per:.0f} each so far, XLA:CPU maps ~3 per compiled kernel), "
                f"past {SHARE:.0%} of this machine's vm.max_map_count={self.limit}. Raise the limit (sudo sysctl -w "
                f"vm.max_map_count=262144), serve fewer models or instances per process, or compile fewer step shapes "
                f"(a smaller --max_seqs or max_tokens_per_step)")

    def compiled(self) -> None:
        self.done += 1
        if self.done == 1:
            self.after_first = map_count()
