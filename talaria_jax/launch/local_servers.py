"""`talaria-route --local_instances=N`: N `talaria-serve` processes on this machine, each on its own
group of devices and a free port of 127.0.0.1, reached over HTTP like remote instances.

One process per instance, as data-parallel serving engines run them: each has its own interpreter,
its own JAX client and its own memory maps. The last matters on CPU: XLA:CPU maps about three
regions per compiled kernel: one SmolLM2 instance's step programs take about 4,700 of Linux's default
`vm.max_map_count` of 65,530 as layer programs, and over a shared weight slot (whole-step programs of
about 1,370 maps each) two instances in one process could not finish compiling.

Devices: on GPUs (`CUDA_VISIBLE_DEVICES`, else `nvidia-smi -L`) each process sees its `tp` GPUs; on
CPU each gets `tp` host devices. The processes take the API keys from the environment (not argv,
which other users of the machine can read), die with the gateway (`PR_SET_PDEATHSIG`), and are
stopped with SIGTERM (they drain) on `close`.
"""
from __future__ import annotations

import ctypes
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Sequence

import httpx

__all__ = ["LocalServers", "StartError", "visible_gpus"]

_DEVICE_FLAG = re.compile(r"--xla_force_host_platform_device_count=\S+")


class StartError(RuntimeError):
    """An instance process exited, or did not answer /health in time, while starting."""


def visible_gpus() -> list[str]:
    """The GPUs this process may use (ids for CUDA_VISIBLE_DEVICES); none on a CPU-only machine or
    with JAX_PLATFORMS=cpu."""
    if os.environ.get("JAX_PLATFORMS", "").split(",")[0] == "cpu":
        return []
    if "CUDA_VISIBLE_DEVICES" in os.environ:
        return [d.strip() for d in os.environ["CUDA_VISIBLE_DEVICES"].split(",") if d.strip()]
    if shutil.which("nvidia-smi") is None:
        return []
    try:
        out = subprocess.run(["nvidia-smi", "-L"], capture_output=True, text=True, timeout=30).stdout
    except (OSError, subprocess.SubprocessError):
        return []
    return [str(i) for i, line in enumerate(ln for ln in out.splitlines() if ln.startswith("GPU "))]


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def _die_with_parent() -> None:  # in the child, before exec: SIGTERM when the gateway dies
    try:
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
    except OSError:
        pass


class LocalServers:
    """`n` `talaria-serve` processes with `serve_args` (its flags, without --port, --host or --tp),
    `tp` devices each (None: 1 on CPU, the visible GPUs split evenly), taking `api_keys`. `urls` are
    their base URLs; `wait_ready` waits until every one answers /health."""

    def __init__(self, n: int, serve_args: Sequence[str], api_keys: Sequence[str], tp: int | None = None,
                 env: dict[str, str] | None = None):
        base = dict(os.environ if env is None else env)
        gpus = visible_gpus()
        tp = tp or (max(1, len(gpus) // n) if gpus else 1)
        if gpus and n * tp > len(gpus):
            raise StartError(f"{n} instances x tp={tp} need {n * tp} GPUs; {len(gpus)} are visible")
        self.urls: list[str] = []
        self.procs: list[subprocess.Popen] = []
        for k in range(n):
            port = free_port()
            env_k = {**base, "TALARIA_API_KEY": ",".join(api_keys)}
            if gpus:
                env_k["CUDA_VISIBLE_DEVICES"] = ",".join(gpus[k * tp:(k + 1) * tp])
            else:
                flags = _DEVICE_FLAG.sub("", base.get("XLA_FLAGS", ""))
                env_k["XLA_FLAGS"] = f"{flags} --xla_force_host_platform_device_count={tp}".strip()
            cmd = [sys.executable, "-m", "talaria_jax.launch.serve", f"--port={port}", "--host=127.0.0.1",
                   f"--tp={tp}", *serve_args]
            self.procs.append(subprocess.Popen(cmd, env=env_k, stdin=subprocess.DEVNULL, preexec_fn=_die_with_parent))
            self.urls.append(f"http://127.0.0.1:{port}")

    def wait_ready(self, timeout_s: float = 3600.0, report_every_s: float = 30.0) -> None:
        """Waits until every instance answers /health with 200 (they compile their step programs
        first); StartError naming the instance if one exits or `timeout_s` passes."""
        t0 = last = time.monotonic()
        waiting = dict(enumerate(self.urls))
        while waiting:
            for k, url in list(waiting.items()):
                code = self.procs[k].poll()
                if code is not None:
                    raise StartError(f"instance i{k} (pid {self.procs[k].pid}) exited with code {code} while "
                                     f"starting; its messages are above")
                try:
                    if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                        del waiting[k]
                except httpx.HTTPError:
                    pass
            now = time.monotonic()
            if waiting and now - t0 > timeout_s:
                raise StartError(f"instances {', '.join(f'i{k}' for k in waiting)} did not start within {timeout_s:.0f} s")
            if waiting and now - last >= report_every_s:
                last = now
                print(f"waiting for {len(waiting)} of {len(self.urls)} instances to load and compile "
                      f"({now - t0:.0f} s)", file=sys.stderr)
            if waiting:
                time.sleep(0.5)

    def close(self, timeout_s: float = 60.0) -> None:
        """SIGTERM to every instance (each drains), then SIGKILL to those still there after `timeout_s`."""
        for p in self.procs:
            if p.poll() is None:
                p.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + timeout_s
        for p in self.procs:
            try:
                p.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()

    def __enter__(self) -> "LocalServers":
        return self

    def __exit__(self, *exc) -> None:
        self.close()
