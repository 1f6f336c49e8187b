"""Soak: host memory under thousands of short agent sessions through the router gateway.

Starts `talaria-route --local_instances=2` (a gateway process and two `talaria-serve` children) with a
small host KV bound (--host_kv_bytes per instance) and a small device KV arena (--kv_mib_per_device),
so sessions' KV leaves the device prefix cache for host memory, and the host copies are evicted
least recently used first once the bound is reached. Then it runs --sessions short scripted agent
sessions (`talaria_jax.serve.load.agent_sessions`: --calls completions calls each, growing prompts,
short tool gaps) at a steady --concurrency through the gateway, with a progress bar over sessions.

Every --sample_s a background thread records the resident memory (VmRSS) of the route process and its
children together and of the gateway alone, each instance's host KV gauges and counters (its
/metrics), and the sessions and errors so far; each sample's call latency percentiles (end-to-end and
TTFT) are those of the calls that ended in its interval.

Then the recompute check: --check_sessions of the first sessions run (their host copies evicted long
before the soak ends) each get one more call (their whole history as the soak ran it, plus a new
observation; same session id; greedy, with logprobs) through the soaked gateway, where their prefix
is recomputed; and the same calls go to a second, fresh route with unbounded host KV, which first
replays those sessions' earlier calls (the same prompts) and then runs --flush_sessions other sessions
so the check sessions' KV has left the device and is restored from host memory. The generated text
and per-token strings must be equal on both sides; the largest difference of the chosen tokens'
logprobs and of the top-2 logprobs, and the smallest top-1/top-2 margin, are reported (the API names
tokens by their decoded text: with a byte tokenizer, bytes of no whole character decode alike, so the
logprobs are what tell such tokens apart). Each instance's `/talaria/probe` shows, before each check
call, how many of its prompt tokens were held on device and on host.

Writes the samples and a summary as JSON (--json_out), optionally a plot (--plot), and prints a table
and a headline. The load average is recorded at the start, at each sample and at the end.

  .venv/bin/python -m benchmarks.soak --sessions=3000 --json_out=/tmp/soak.json --plot=docs/benchmarks/soak.png
  .venv/bin/python -m benchmarks.soak --sessions=3000 --nonamed   # anonymous sessions, inferred at the gateway
"""
from __future__ import annotations

import dataclasses
import math
import os
import re
import secrets
import signal
import subprocess
import sys
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import numpy as np
import openai
from absl import app, flags, logging
from tqdm import tqdm

from benchmarks import common
from talaria_jax.launch.local_servers import free_port
from talaria_jax.serve import load

_MODEL = flags.DEFINE_string("model", "tiny-dense", "The model both instances host.")
_SESSIONS = flags.DEFINE_integer("sessions", 3000, "Agent sessions in the soak.", lower_bound=1)
_CONCURRENCY = flags.DEFINE_integer("concurrency", 16, "Sessions in flight at once.", lower_bound=1)
_CALLS = flags.DEFINE_integer("calls", 3, "Calls per session.", lower_bound=1)
_MAX_TOKENS = flags.DEFINE_integer("max_tokens", 8, "max_tokens of each soak call.", lower_bound=1)
_OBS_WORDS = flags.DEFINE_list("obs_words", ["10", "30"], "Words of each observation: lowest,highest.")
_TOOL_GAP = flags.DEFINE_float("tool_gap_s", 0.1, "Median tool gap between a session's calls (s).", lower_bound=0.0)
_HOST_KV = flags.DEFINE_string("host_kv_bytes", "32M", "--host_kv_bytes of each instance of the soaked route.")
_KV_MIB = flags.DEFINE_integer("kv_mib_per_device", 32, "Device KV arena per instance (MiB).", lower_bound=1)
_MAX_LEN = flags.DEFINE_integer("max_model_len", 2048, "Context limit (tokens).", lower_bound=16)
_MAX_SEQS = flags.DEFINE_integer("max_seqs", 16, "Requests decoding at once per instance.", lower_bound=1)
_MAX_SESSIONS = flags.DEFINE_integer("max_sessions", None, "--max_sessions of each instance (default: the "
                                     "server's).", lower_bound=1)
_POLICY = flags.DEFINE_string("policy", "talaria", "Scheduling policy of the routes.")
_WARMUP = flags.DEFINE_bool("warmup", True, "Instances compile every step shape before serving.")
_SAMPLE_S = flags.DEFINE_float("sample_s", 5.0, "Seconds between samples.", lower_bound=0.1)
_CHECK = flags.DEFINE_integer("check_sessions", 20, "Early sessions continued after the soak and compared.",
                              lower_bound=0)
_CHECK_TOKENS = flags.DEFINE_integer("check_tokens", 16, "max_tokens of each check call.", lower_bound=1)
_FLUSH = flags.DEFINE_integer("flush_sessions", 32, "Sessions the fresh route runs between the replay and the "
                              "check calls (they push the check sessions' KV off the device).", lower_bound=0)
_PLATEAU = flags.DEFINE_float("plateau_pct", 5.0, "RSS may grow at most this much (%) over the last half of the soak.")
_SEED = flags.DEFINE_integer("seed", 0, "Seed of the scripted sessions.")
_NAMED = flags.DEFINE_bool("named", True, "The soak's calls name their session (x-session-id); --nonamed: none does, "
                           "and the gateway infers every session from the prompts.")
_START_TIMEOUT = flags.DEFINE_float("start_timeout_s", 1800.0, "How long a route may take to start.")
_JSON = flags.DEFINE_string("json_out", "/tmp/soak.json", "Write the samples and the summary here.")
_PLOT = flags.DEFINE_string("plot", None, "Write a PNG of RSS, host KV, evictions and latency over time here.")

_GB = 1e9
_METRIC_LINE = re.compile(r"^talaria:(\w+)(?:\{[^}]*\})? (\S+)$", re.M)
_INSTANCE_METRICS = ("host_kv_bytes", "host_kv_capacity_bytes", "host_kv_copies", "host_kv_evictions_total",
                     "host_restored_tokens_total", "recomputed_prefix_tokens_total", "sessions_held",
                     "prefix_cache_hits_total", "kv_pages_used", "kv_pages_total")


# --- the route process ---------------------------------------------------------------------------

class Route:
    """A `talaria-route --local_instances=2` process on a free port with a fresh API key (given in
    the environment, not argv); its output goes to `log_path`. `stop()` sends SIGTERM (the instances
    drain and stop with it) and kills it if it is still there after `timeout_s`."""

    def __init__(self, host_kv_bytes: str, label: str):
        self.key = "sk-soak-" + secrets.token_urlsafe(16)
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log_path = os.path.join(tempfile.gettempdir(), f"soak_route_{label}_{self.port}.log")
        args = [f"--model={_MODEL.value}", "--local_instances=2", f"--port={self.port}", f"--policy={_POLICY.value}",
                f"--host_kv_bytes={host_kv_bytes}", f"--kv_mib_per_device={_KV_MIB.value}",
                f"--max_model_len={_MAX_LEN.value}", f"--max_seqs={_MAX_SEQS.value}",
                "--warmup" if _WARMUP.value else "--nowarmup", f"--start_timeout_s={_START_TIMEOUT.value}"]
        if _MAX_SESSIONS.value:
            args.append(f"--max_sessions={_MAX_SESSIONS.value}")
        self.args = args
        with open(self.log_path, "w") as log:
            self.proc = subprocess.Popen([sys.executable, "-m", "talaria_jax.launch.route", *args],
                                         env={**os.environ, "TALARIA_API_KEY": self.key}, stdin=subprocess.DEVNULL,
                                         stdout=log, stderr=subprocess.STDOUT)
        self.instances: list[dict] = []

    def wait(self, timeout_s: float) -> float:
        """Waits until both instances are up (the gateway's /health); the seconds it took."""
        t0 = time.monotonic()
        while True:
            if self.proc.poll() is not None:
                raise RuntimeError(f"talaria-route exited with code {self.proc.returncode} while starting:\n"
                                   f"{self.log_tail()}")
            try:
                health = httpx.get(f"{self.url}/health", timeout=2).json()
                if health.get("instances_up") == 2:
                    self.instances = health["instances"]
                    return time.monotonic() - t0
            except (httpx.HTTPError, ValueError):
                pass
            if time.monotonic() - t0 > timeout_s:
                raise RuntimeError(f"talaria-route did not start within {timeout_s:.0f} s:\n{self.log_tail()}")
            time.sleep(1.0)

    def log_tail(self, lines: int = 30) -> str:
        with open(self.log_path, errors="replace") as f:
            return "".join(f.readlines()[-lines:])

    def metrics(self) -> list[dict[str, float]]:
        """Each instance's talaria metrics of `_INSTANCE_METRICS` (NaN where a scrape failed)."""
        out = []
        for inst in self.instances:
            try:
                text = httpx.get(f"{inst['url']}/metrics", headers={"Authorization": f"Bearer {self.key}"},
                                 timeout=10).text
                got = {name: float(v) for name, v in _METRIC_LINE.findall(text)}
                out.append({m: got.get(m, math.nan) for m in _INSTANCE_METRICS})
            except httpx.HTTPError:
                out.append({m: math.nan for m in _INSTANCE_METRICS})
        return out

    def rss(self) -> tuple[int, int, list[int]]:
        """VmRSS (bytes) of the route and all its descendants together, of the gateway process alone,
        and of each direct child (the instances)."""
        pid = self.proc.pid
        kids = common.children(pid)
        return (sum(map(common.rss_bytes, common.descendants(pid))), common.rss_bytes(pid),
                [common.rss_bytes(k) for k in kids])

    def stop(self, timeout_s: float = 120.0) -> int | None:
        """SIGTERM, then SIGKILL after `timeout_s`; the exit code."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=timeout_s)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        return self.proc.returncode

    def __enter__(self) -> "Route":
        return self

    def __exit__(self, kind, *_) -> None:
        self.stop(timeout_s=120.0 if kind is None else 10.0)


# --- the soak ------------------------------------------------------------------------------------

@dataclasses.dataclass
class Progress:
    """What the soak has done so far, shared by the session threads and the sampler."""
    t0: float
    sessions: int = 0
    calls: int = 0
    errors: int = 0
    call_ends: list[tuple[float, float, float]] = dataclasses.field(default_factory=list)  # (end s, e2e s, ttft s)
    lock: threading.Lock = dataclasses.field(default_factory=threading.Lock)


def run_pool(route: Route, sessions: list[load.AgentSession], concurrency: int, progress: Progress,
             bar: tqdm | None = None) -> list[load.SessionResult]:
    """Runs `sessions` with at most `concurrency` in flight (a new one starts as one ends), each with
    `load`'s per-session runner (greedy, streamed); results in the order of `sessions`."""
    def one(s: load.AgentSession) -> load.SessionResult:
        ends: list[float] = []
        named = {"x-session-id": s.id} if _NAMED.value else {}  # none: the gateway infers each session
        r = load._run_session(route.url, route.key, s, 0.0, 300.0, {"temperature": 0.0, "extra_headers": named},
                              lambda _: ends.append(time.perf_counter() - progress.t0))
        with progress.lock:
            progress.sessions += 1
            progress.calls += len(r.calls)
            progress.errors += len(r.errors)
            progress.call_ends += [(end, c.e2e_s, c.ttft_s) for end, c in zip(ends, r.calls)]
        if bar is not None:
            bar.update(1)
        return r

    with ThreadPoolExecutor(max_workers=concurrency) as pool:
        return list(pool.map(one, sessions))


def sampler(route: Route, progress: Progress, every_s: float, stop: threading.Event, samples: list[dict]) -> None:
    """Appends a sample every `every_s` until `stop` is set, and one last sample then."""
    while True:
        samples.append(take_sample(route, progress))
        if stop.wait(every_s):
            samples.append(take_sample(route, progress))
            return


def take_sample(route: Route, progress: Progress) -> dict:
    total, gateway, instances = route.rss()
    with progress.lock:
        done = dict(sessions_done=progress.sessions, calls_done=progress.calls, errors=progress.errors)
    return dict(elapsed_s=time.perf_counter() - progress.t0, **done, rss_bytes=total, gateway_rss_bytes=gateway,
                instance_rss_bytes=instances, load1=os.getloadavg()[0], instances=route.metrics())


def add_latencies(samples: list[dict], call_ends: list[tuple[float, float, float]]) -> None:
    """Each sample's p50/p95 of end-to-end latency and TTFT over the calls that ended since the previous one."""
    ends = np.array([c[0] for c in call_ends])
    e2e = np.array([c[1] for c in call_ends])
    ttft = np.array([c[2] for c in call_ends])
    prev = -math.inf
    for s in samples:
        sel = (ends > prev) & (ends <= s["elapsed_s"])
        prev = s["elapsed_s"]
        s["interval_calls"] = int(sel.sum())
        for name, xs in (("e2e", e2e[sel]), ("ttft", ttft[sel][np.isfinite(ttft[sel])])):
            qs = np.quantile(xs, [0.5, 0.95]) if len(xs) else (math.nan, math.nan)
            s[f"{name}_p50_s"], s[f"{name}_p95_s"] = float(qs[0]), float(qs[1])


# --- the recompute check -------------------------------------------------------------------------

def prompts_of(s: load.AgentSession, r: load.SessionResult) -> tuple[list[str], str]:
    """The prompts of a soaked completions session's calls as `load` sent them (its system text,
    then each observation followed by the answer and a newline), and its history after the last call."""
    prompt, prompts = s.system + "\n", []
    for obs, call in zip(s.observations, r.calls):
        prompt += obs
        prompts.append(prompt)
        prompt += call.text + "\n"
    return prompts, prompt


def probe(route: Route, sid: str, prompt: str, max_tokens: int) -> list[dict]:
    """Each instance's prefix held for this session's call: device and host tokens of the prompt."""
    out = []
    for inst in route.instances:
        r = httpx.post(f"{inst['url']}/talaria/probe", params={"kind": "completion"}, timeout=30,
                       headers={"Authorization": f"Bearer {route.key}", "x-session-id": sid},
                       json={"model": _MODEL.value, "prompt": prompt, "max_tokens": max_tokens})
        if r.status_code != 200:
            raise RuntimeError(f"probe of {sid} on {inst['name']}: {r.status_code} {r.text[:300]}")
        j = r.json()
        out.append({"prompt_tokens": j["prompt_tokens"], "device_tokens": j["device_tokens"],
                    "host_tokens": j["host_tokens"]})
    return out


def check_call(route: Route, sid: str, prompt: str, max_tokens: int) -> dict:
    """One greedy, non-streamed completions call of session `sid` with top-2 logprobs, and the probe
    of every instance just before it."""
    held = probe(route, sid, prompt, max_tokens)
    with openai.OpenAI(base_url=f"{route.url}/v1", api_key=route.key, max_retries=0, timeout=300) as client:
        r = client.completions.create(model=_MODEL.value, prompt=prompt, max_tokens=max_tokens, temperature=0.0,
                                      logprobs=2, extra_headers={"x-session-id": sid})
    c = r.choices[0]
    lp = c.logprobs
    margins = [sorted(top.values(), reverse=True) for top in (lp.top_logprobs or [])]
    return dict(session=sid, held=held, text=c.text, tokens=list(lp.tokens), logprobs=list(lp.token_logprobs),
                tops=[dict(t) for t in lp.top_logprobs or []], margins=[m[0] - m[1] for m in margins if len(m) > 1],
                cached_tokens=(r.usage.prompt_tokens_details.cached_tokens or 0) if r.usage.prompt_tokens_details else 0)


def replay_call(route: Route, sid: str, prompt: str, max_tokens: int) -> str:
    """One greedy call of session `sid` (the fresh route's replay of a soaked call); its text."""
    with openai.OpenAI(base_url=f"{route.url}/v1", api_key=route.key, max_retries=0, timeout=300) as client:
        r = client.completions.create(model=_MODEL.value, prompt=prompt, max_tokens=max_tokens, temperature=0.0,
                                      extra_headers={"x-session-id": sid})
    return r.choices[0].text


def counters_delta(before: list[dict], after: list[dict], name: str) -> float:
    return sum(a[name] - b[name] for a, b in zip(after, before))


# --- report --------------------------------------------------------------------------------------

def summarize(samples: list[dict], check: dict, soak_s: float, bound: float) -> dict:
    """The summary: counts, RSS at 10%/50%/end and its max, the plateau check, host KV vs its bound,
    evictions, latency over time, the recompute check."""
    last = samples[-1]
    at = lambda frac: min(samples, key=lambda s: abs(s["elapsed_s"] - frac * soak_s))
    rss = [s["rss_bytes"] for s in samples]
    mid = at(0.5)
    growth = 100.0 * (last["rss_bytes"] - mid["rss_bytes"]) / mid["rss_bytes"]
    host_max = max(i["host_kv_bytes"] for s in samples for i in s["instances"])
    quarters = [samples[k * (len(samples) - 1) // 4] for k in range(5)]
    return dict(
        sessions=last["sessions_done"], calls=last["calls_done"], errors=last["errors"], soak_s=soak_s,
        rss_start_bytes=samples[0]["rss_bytes"], rss_10pct_bytes=at(0.1)["rss_bytes"], rss_50pct_bytes=mid["rss_bytes"],
        rss_end_bytes=last["rss_bytes"], rss_max_bytes=max(rss),
        gateway_rss_start_bytes=samples[0]["gateway_rss_bytes"], gateway_rss_end_bytes=last["gateway_rss_bytes"],
        rss_growth_last_half_pct=growth, plateau=growth < _PLATEAU.value, plateau_pct=_PLATEAU.value,
        host_kv_max_bytes=host_max, host_kv_bound_bytes=bound, host_kv_within_bound=host_max <= bound,
        evictions=sum(i["host_kv_evictions_total"] for i in last["instances"]),
        recomputed_prefix_tokens=sum(i["recomputed_prefix_tokens_total"] for i in last["instances"]),
        host_restored_tokens=sum(i["host_restored_tokens_total"] for i in last["instances"]),
        sessions_held_end=sum(i["sessions_held"] for i in last["instances"]),
        latency_over_time=[{k: s[k] for k in ("elapsed_s", "e2e_p50_s", "e2e_p95_s")} for s in quarters],
        check=check)


def headline(sm: dict) -> str:
    c = sm["check"]
    return (f"{sm['sessions']} sessions, {sm['calls']} calls, {sm['errors']} errors; RSS "
            f"{sm['rss_10pct_bytes'] / _GB:.2f} GB -> {sm['rss_end_bytes'] / _GB:.2f} GB "
            f"({'plateau' if sm['plateau'] else 'NO plateau'}: {sm['rss_growth_last_half_pct']:+.1f}% over the last "
            f"half), host KV {'<=' if sm['host_kv_within_bound'] else 'ABOVE'} bound "
            f"({sm['host_kv_max_bytes'] / 2**20:.1f} of {sm['host_kv_bound_bytes'] / 2**20:.0f} MiB per instance), "
            f"{sm['evictions']:.0f} evictions, {c['matches']}/{c['sessions']} evicted sessions continue with the same "
            f"greedy tokens")


def table(samples: list[dict], soak_s: float) -> str:
    rows = ["| at | elapsed s | sessions | errors | RSS GB (all) | gateway GB | host KV MiB (i0, i1) | copies | "
            "evictions | sessions held | recomputed tok | e2e p50/p95 s | load1 |", "|---" * 13 + "|"]
    for label, frac in (("start", 0.0), ("10%", 0.1), ("25%", 0.25), ("50%", 0.5), ("75%", 0.75), ("end", 2.0)):
        s = min(samples, key=lambda x: abs(x["elapsed_s"] - frac * soak_s))
        ins = s["instances"]
        host = ", ".join(f"{i['host_kv_bytes'] / 2**20:.1f}" for i in ins)
        rows.append(f"| {label} | {s['elapsed_s']:.0f} | {s['sessions_done']} | {s['errors']} | "
                    f"{s['rss_bytes'] / _GB:.3f} | {s['gateway_rss_bytes'] / _GB:.3f} | "
                    f"{host} | "
                    f"{sum(i['host_kv_copies'] for i in ins):.0f} | {sum(i['host_kv_evictions_total'] for i in ins):.0f} | "
                    f"{sum(i['sessions_held'] for i in ins):.0f} | "
                    f"{sum(i['recomputed_prefix_tokens_total'] for i in ins):.0f} | "
                    f"{s.get('e2e_p50_s', math.nan):.3f}/{s.get('e2e_p95_s', math.nan):.3f} | {s['load1']:.2f} |")
    return "\n".join(rows)


def plot(samples: list[dict], bound: float, path: str, title: str) -> None:
    """RSS (all processes, gateway) on top; host KV bytes per instance with the bound dashed and
    evictions on a second axis in the middle; call latency p50/p95 below; minutes on x."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    t = np.array([s["elapsed_s"] for s in samples]) / 60
    fig, (a0, a1, a2) = plt.subplots(3, 1, figsize=(8, 8), sharex=True)
    a0.plot(t, [s["rss_bytes"] / _GB for s in samples], label="route + 2 instances")
    for k in range(len(samples[0]["instance_rss_bytes"])):
        a0.plot(t, [s["instance_rss_bytes"][k] / _GB if k < len(s["instance_rss_bytes"]) else math.nan
                    for s in samples], lw=0.8, label=f"instance i{k}")
    a0.plot(t, [s["gateway_rss_bytes"] / _GB for s in samples], lw=0.8, label="gateway")
    a0.set(ylabel="RSS (GB)", title=title)
    a0.set_ylim(bottom=0)
    a0.legend(fontsize=7, loc="center right")
    for k in range(len(samples[0]["instances"])):
        a1.plot(t, [s["instances"][k]["host_kv_bytes"] / 2**20 for s in samples], lw=0.8, label=f"host KV i{k}")
    a1.axhline(bound / 2**20, ls="--", color="k", lw=1, label="bound (per instance)")
    a1.set(ylabel="host KV (MiB)")
    a1.set_ylim(0, bound / 2**20 * 1.25)
    ev = a1.twinx()
    ev.plot(t, [sum(i["host_kv_evictions_total"] for i in s["instances"]) for s in samples], color="tab:red", lw=1,
            label="evictions (both)")
    ev.set_ylabel("host KV evictions", color="tab:red")
    h0, l0 = a1.get_legend_handles_labels()
    h1, l1 = ev.get_legend_handles_labels()
    a1.legend(h0 + h1, l0 + l1, fontsize=7, loc="lower right")
    a2.plot(t, [s.get("e2e_p50_s", math.nan) for s in samples], label="call p50")
    a2.plot(t, [s.get("e2e_p95_s", math.nan) for s in samples], label="call p95")
    a2.set(xlabel="minutes", ylabel="call latency (s)")
    a2.set_ylim(bottom=0)
    a2.legend(fontsize=7)
    for a in (a0, a1, a2):
        a.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


# --- main ----------------------------------------------------------------------------------------

def main(argv):
    del argv
    logging.set_verbosity(logging.WARNING)
    lo, hi = (int(w) for w in _OBS_WORDS.value)
    n, k = _SESSIONS.value, min(_CHECK.value, _SESSIONS.value)
    # calls + 1 observations each: the soak runs the first `calls`, the check call brings the last
    scripted = load.agent_sessions(n, _CALLS.value + 1, [_MODEL.value], seed=_SEED.value, max_tokens=_MAX_TOKENS.value,
                                   obs_words=(lo, hi), tool_gap_s=_TOOL_GAP.value)
    soak_sessions = [dataclasses.replace(s, observations=s.observations[:-1]) for s in scripted]
    flush = [dataclasses.replace(s, id=f"flush{j}") for j, s in enumerate(
        load.agent_sessions(_FLUSH.value, _CALLS.value, [_MODEL.value], seed=_SEED.value + 1,
                            max_tokens=_MAX_TOKENS.value, obs_words=(lo, hi), tool_gap_s=_TOOL_GAP.value))]
    machine = dict(cpus=os.cpu_count(), load_start=os.getloadavg(),
                   mem_total_bytes=os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"))
    t_start = time.perf_counter()

    # the soak
    with Route(_HOST_KV.value, "soaked") as route:
        print(f"starting talaria-route ({' '.join(route.args)}); its log: {route.log_path}", file=sys.stderr)
        start_s = route.wait(_START_TIMEOUT.value)
        bound = route.metrics()[0]["host_kv_capacity_bytes"]
        print(f"up in {start_s:.0f} s; {n} sessions at concurrency {_CONCURRENCY.value}", file=sys.stderr)
        progress, samples, stop = Progress(time.perf_counter()), [], threading.Event()
        thread = threading.Thread(target=sampler, args=(route, progress, _SAMPLE_S.value, stop, samples), daemon=True)
        thread.start()
        with tqdm(total=n, unit="session", file=sys.stderr, mininterval=1.0 if sys.stderr.isatty() else 30.0) as bar:
            results = run_pool(route, soak_sessions, _CONCURRENCY.value, progress, bar)
        soak_s = time.perf_counter() - progress.t0
        stop.set()
        thread.join()
        add_latencies(samples, progress.call_ends)
        first_errors = [e for r in results for e in r.errors][:5]

        # the check sessions' continuation on the soaked route (their host copies long evicted)
        histories = {s.id: prompts_of(s, r) for s, r in zip(soak_sessions[:k], results[:k]) if not r.errors}
        cont = {s.id: histories[s.id][1] + s.observations[-1] for s in scripted[:k] if s.id in histories}
        before = route.metrics()
        soaked = {sid: check_call(route, sid, p, _CHECK_TOKENS.value) for sid, p in cont.items()}
        after = route.metrics()
        soaked_counts = dict(recomputed_prefix_tokens=counters_delta(before, after, "recomputed_prefix_tokens_total"),
                             host_restored_tokens=counters_delta(before, after, "host_restored_tokens_total"))
        code = route.stop()
    print(f"soaked route stopped (exit code {code}); starting a fresh one with unbounded host KV", file=sys.stderr)

    # the same continuations on a fresh route that keeps every session's KV on host
    with Route("unbounded", "fresh") as fresh:
        fresh.wait(_START_TIMEOUT.value)
        replay_equal = replay_total = 0
        for s, r in zip(soak_sessions[:k], results[:k]):
            if s.id not in cont:
                continue
            for prompt, call in zip(histories[s.id][0], r.calls):
                replay_total += 1
                replay_equal += replay_call(fresh, s.id, prompt, s.max_tokens) == call.text
        run_pool(fresh, flush, _CONCURRENCY.value, Progress(time.perf_counter()))
        before = fresh.metrics()
        reference = {sid: check_call(fresh, sid, p, _CHECK_TOKENS.value) for sid, p in cont.items()}
        after = fresh.metrics()
        fresh_counts = dict(recomputed_prefix_tokens=counters_delta(before, after, "recomputed_prefix_tokens_total"),
                            host_restored_tokens=counters_delta(before, after, "host_restored_tokens_total"))
    machine["load_end"] = os.getloadavg()

    per_session = []
    for sid in cont:
        a, b = soaked[sid], reference[sid]
        per_session.append(dict(
            session=sid, equal=a["text"] == b["text"] and a["tokens"] == b["tokens"], text_soaked=a["text"],
            text_fresh=b["text"], max_logprob_diff=max((abs(x - y) for x, y in zip(a["logprobs"], b["logprobs"])),
                                                       default=0.0),
            tops_equal=[sorted(x) for x in a["tops"]] == [sorted(y) for y in b["tops"]],
            max_top_logprob_diff=max((abs(x[t] - y[t]) for x, y in zip(a["tops"], b["tops"]) for t in x.keys() & y.keys()),
                                     default=0.0),
            min_margin=min(a["margins"] + b["margins"], default=None),
            held_soaked=a["held"], held_fresh=b["held"], cached_soaked=a["cached_tokens"],
            cached_fresh=b["cached_tokens"]))
    check = dict(sessions=len(per_session), matches=sum(p["equal"] for p in per_session),
                 replayed_calls=replay_total, replayed_calls_equal=replay_equal,
                 max_logprob_diff=max((p["max_logprob_diff"] for p in per_session), default=0.0),
                 tops_equal=sum(p["tops_equal"] for p in per_session),
                 max_top_logprob_diff=max((p["max_top_logprob_diff"] for p in per_session), default=0.0),
                 min_margin=min((p["min_margin"] for p in per_session if p["min_margin"] is not None), default=None),
                 soaked_host_tokens_held=sum(max(h["host_tokens"] for h in p["held_soaked"]) for p in per_session),
                 fresh_host_tokens_held=sum(max(h["host_tokens"] for h in p["held_fresh"]) for p in per_session),
                 soaked=soaked_counts, fresh=fresh_counts, per_session=per_session)
    sm = summarize(samples, check, soak_s, bound)
    sm |= dict(route_start_s=start_s, total_s=time.perf_counter() - t_start, first_errors=first_errors)
    config = {f: flags.FLAGS[f].value for f in ("model", "sessions", "concurrency", "calls", "max_tokens", "obs_words",
                                               "tool_gap_s", "host_kv_bytes", "kv_mib_per_device", "max_model_len",
                                               "max_seqs", "max_sessions", "policy", "sample_s", "check_sessions",
                                               "check_tokens", "flush_sessions", "seed")}

    print()
    print(table(samples, soak_s))
    print(f"\nrecompute check: {check['matches']}/{check['sessions']} equal (text and tokens); largest logprob "
          f"difference {check['max_logprob_diff']:.2e} (chosen tokens), {check['max_top_logprob_diff']:.2e} (top-2, "
          f"same candidates in {check['tops_equal']}/{check['sessions']}); smallest top-1/top-2 margin "
          f"{check['min_margin']}; prompt tokens held on host before the check calls: soaked "
          f"{check['soaked_host_tokens_held']}, fresh {check['fresh_host_tokens_held']}; during them, recomputed / "
          f"restored tokens: soaked {soaked_counts['recomputed_prefix_tokens']:.0f} / "
          f"{soaked_counts['host_restored_tokens']:.0f}, fresh {fresh_counts['recomputed_prefix_tokens']:.0f} / "
          f"{fresh_counts['host_restored_tokens']:.0f}; replayed earlier calls equal {replay_equal}/{replay_total}")
    for p in per_session:
        if not p["equal"]:
            print(f"  MISMATCH {p['session']}: soaked {p['text_soaked']!r} vs fresh {p['text_fresh']!r} "
                  f"(smallest top-1/top-2 margin {p['min_margin']})")
    if first_errors:
        print("first errors:", *first_errors, sep="\n  ")
    print(f"machine: {machine['cpus']} cpus, load average {machine['load_start'][0]:.2f} at the start, "
          f"{machine['load_end'][0]:.2f} at the end; soak {soak_s / 60:.1f} min, all {sm['total_s'] / 60:.1f} min")
    print(headline(sm))
    if _JSON.value:
        common.write_json(_JSON.value, dict(config=config, machine=machine, summary=sm, headline=headline(sm),
                                            samples=samples))
        print(f"wrote {_JSON.value}")
    if _PLOT.value:
        plot(samples, bound, _PLOT.value, f"soak: {n} sessions x {_CALLS.value} calls through talaria-route, "
                                          f"2 x {_MODEL.value}, concurrency {_CONCURRENCY.value}")
        print(f"wrote {_PLOT.value}")


if __name__ == "__main__":
    app.run(main)
