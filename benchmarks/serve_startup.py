"""How long `talaria-serve` (or `talaria-route --local_instances=N`) takes to be ready from a cold
compilation cache, and the memory maps and RSS its processes peak at on the way.

Each run starts the launcher as a user would (`python -m talaria_jax.launch.serve`, the given flags,
a fresh empty compilation cache through $TALARIA_COMPILATION_CACHE, a free port), samples every
process of its tree (`/proc/PID/maps` lines, VmRSS) every `--sample_s`, and polls `GET /v1/models`
until it answers 200: that is "ready". Then it asks one greedy question and prints the answer, and
stops the server with SIGTERM. `--before=REF` also runs the launcher of git revision REF (a
worktree under /tmp; the native suffix module is copied from this tree), the two sides in turns
(before, after, after, before, ...), so the same machine state falls on both.

  .venv/bin/python -m benchmarks.serve_startup
  .venv/bin/python -m benchmarks.serve_startup --before=HEAD~3 --runs=2
  .venv/bin/python -m benchmarks.serve_startup --launcher=route --args=--local_instances=2
"""
from __future__ import annotations

import atexit
import json
import os
import pathlib
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import tomllib
import urllib.error
import urllib.request

from absl import app, flags

from benchmarks import common
from talaria_jax.engine.memory_maps import map_count
from talaria_jax.launch.local_servers import free_port

_LAUNCHER = flags.DEFINE_enum("launcher", "serve", ["serve", "route"], "talaria-serve or talaria-route.")
_ARGS = flags.DEFINE_list("args", [], "Flags for the launcher, comma-separated (default: its defaults).")
_BEFORE = flags.DEFINE_string("before", None, "A git revision whose launcher runs beside this tree's, in turns.")
_RUNS = flags.DEFINE_integer("runs", 1, "Runs of each side.", lower_bound=1)
_SAMPLE = flags.DEFINE_float("sample_s", 1.0, "Seconds between samples of maps and RSS.")
_TIMEOUT = flags.DEFINE_float("timeout_s", 1800.0, "Give up on a run after this long.")
_OUT = flags.DEFINE_string("out", None, "Write the runs as JSON here.")

ROOT = pathlib.Path(__file__).resolve().parent.parent
KEY = "sk-startup"
QUESTION = "What is the capital of France?"


def sample(pid: int) -> dict[int, tuple[int, int]]:
    """Each process of `pid`'s tree: (memory maps, RSS bytes)."""
    return {p: (maps, common.rss_bytes(p)) for p in common.descendants(pid) if (maps := map_count(p)) is not None}


def request(port: int, path: str, body: dict | None = None, timeout: float = 5.0) -> tuple[int, dict | None]:
    req = urllib.request.Request(f"http://127.0.0.1:{port}{path}", data=None if body is None else json.dumps(body).encode(),
                                 headers={"Authorization": f"Bearer {KEY}", "Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, None
    except (OSError, ValueError):
        return 0, None


def worktree(rev: str) -> pathlib.Path:
    """A checkout of `rev` under /tmp (removed from git's list at exit), with this tree's native modules
    copied in, and its top-level packages linked where pyproject.toml's package-dir puts them
    (talaria_jax.kvcache is kvcache/, ...): the editable install would take them from this tree."""
    sha = subprocess.run(["git", "rev-parse", rev], cwd=ROOT, check=True, capture_output=True, text=True).stdout.strip()
    path = pathlib.Path(tempfile.mkdtemp(prefix=f"talaria_startup_{sha[:12]}_"))
    subprocess.run(["git", "worktree", "add", "--force", "--detach", str(path), sha], cwd=ROOT, check=True,
                   capture_output=True)
    atexit.register(subprocess.run, ["git", "worktree", "remove", "--force", str(path)], cwd=ROOT, capture_output=True)
    dirs = tomllib.loads((path / "pyproject.toml").read_text())["tool"]["setuptools"].get("package-dir", {})
    for folder in {"talaria_jax", *dirs.values()}:
        for so in ROOT.glob(f"{folder}/**/*.so"):
            dest = path / so.relative_to(ROOT)
            if dest.parent.exists() and not dest.exists():
                shutil.copy2(so, dest)
    for package, folder in dirs.items():
        link = path / package.replace(".", "/")
        if folder != package.replace(".", "/") and (path / folder).is_dir() and not link.exists():
            link.symlink_to(path / folder, target_is_directory=True)
    return path


def run_once(source: pathlib.Path) -> dict:
    port, cache = free_port(), tempfile.mkdtemp(prefix="talaria_startup_cache_")
    env = {**os.environ, "PYTHONPATH": str(source), "TALARIA_COMPILATION_CACHE": cache, "TALARIA_API_KEY": KEY}
    cmd = [sys.executable, "-m", f"talaria_jax.launch.{_LAUNCHER.value}", f"--port={port}", *_ARGS.value]
    load = os.getloadavg()
    t0 = time.perf_counter()
    log = tempfile.TemporaryFile("w+")  # (a pipe nobody reads until the end could fill and block the server)
    proc = subprocess.Popen(cmd, cwd=source, env=env, stdout=log, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)
    peak_maps: dict[int, int] = {}
    peak_rss = [0]
    ready = None

    def observe():
        now = sample(proc.pid)
        for p, (maps, _) in now.items():
            peak_maps[p] = max(peak_maps.get(p, 0), maps)
        peak_rss[0] = max(peak_rss[0], sum(rss for _, rss in now.values()))

    try:
        while time.perf_counter() - t0 < _TIMEOUT.value:
            observe()
            if proc.poll() is not None:
                break
            status, models = request(port, "/v1/models", timeout=2)
            if status == 200:
                ready = time.perf_counter() - t0
                break
            time.sleep(_SAMPLE.value)
        answer = None
        if ready is not None:
            _, r = request(port, "/v1/chat/completions", {"model": models["data"][0]["id"], "temperature": 0, "max_tokens": 16,
                                                         "messages": [{"role": "user", "content": QUESTION}]}, timeout=300)
            answer = r["choices"][0]["message"]["content"] if r else None
            observe()
    finally:
        for sig, wait in ((signal.SIGTERM, 60), (signal.SIGKILL, None)):
            try:
                os.killpg(proc.pid, sig)  # the server and the processes it started
                proc.wait(wait)
                break
            except ProcessLookupError:
                break
            except subprocess.TimeoutExpired:
                continue
        log.seek(0)
        out = log.read()
        log.close()
        shutil.rmtree(cache, ignore_errors=True)
    return {"ready_s": None if ready is None else round(ready, 1), "peak_maps": sorted(peak_maps.values(), reverse=True),
            "peak_rss_gb": round(peak_rss[0] / 1e9, 2), "answer": answer, "load": [round(x, 2) for x in load],
            "log_tail": None if ready is not None else out[-2000:]}


def main(argv):
    del argv
    sides = {"this tree": ROOT}
    if _BEFORE.value:
        sides = {f"before ({_BEFORE.value})": worktree(_BEFORE.value), **sides}
    machine = common.Machine.start(threads=os.cpu_count() or 1)
    names, rows = list(sides), []
    for rep in range(_RUNS.value):
        for name in (names if rep % 2 == 0 else names[::-1]):
            r = {"side": name, "run": rep, **run_once(sides[name])}
            print(json.dumps(r), flush=True)
            rows.append(r)
    machine.stop()
    print(f"\ntalaria-{_LAUNCHER.value} {' '.join(_ARGS.value)} (empty compilation cache each run)")
    print(common.markdown_header(["side", "run", "ready after (s)", "peak maps (largest process)", "peak RSS, all processes (GB)",
                                  "load at start", "answer"]))
    for r in rows:
        print(f"| {r['side']} | {r['run']} | {r['ready_s']} | {r['peak_maps'][0] if r['peak_maps'] else '-'} | "
              f"{r['peak_rss_gb']} | {' / '.join(map(str, r['load']))} | {r['answer']!r} |")
    print(machine.report())
    common.write_json(_OUT.value, {"runs": rows}, machine)


if __name__ == "__main__":
    app.run(main)
