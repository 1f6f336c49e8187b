"""Instance servers and a gateway in one process, on 127.0.0.1: `make demo`, `benchmarks/serve_load.py`
and the serving tests run on it (`talaria-route --local_instances` starts processes instead:
`launch/local_servers.py`).

`LocalCluster` starts one instance server per group of local devices, each hosting every model given
(an `InstanceEngine` under a policy), over HTTP on free ports. `gateway(policy)` puts every instance
under `policy` (emptied first, compiled programs kept) and serves a gateway over them, so several
policies can be compared on the same instances.
"""
from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Iterator, Mapping, Sequence

from talaria_jax.engine import enable_compilation_cache
from talaria_jax.engine.engine import EngineConfig
from talaria_jax.local import LOCAL_KV_BYTES, build_instances, simulate_cpu_devices
from talaria_jax.scheduler.policies import PolicyConfig, get_policy
from talaria_jax.serve.app import ServedModel, build_app, serve_in_thread
from talaria_jax.serve.gateway import build_gateway
from talaria_jax.serve.instance_engine import InstanceEngine
from talaria_jax.serve.load import AgentSession, SessionResult, agent_sessions, run_sessions
from talaria_jax.serve.protocol import Limits
from talaria_jax.serve.responses import Store
from talaria_jax.sim.hardware import HardwareConfig, load_hardware

__all__ = ["LocalCluster", "demo_cluster", "demo_sessions", "instance_apps"]


def instance_apps(models: Sequence[str] | Mapping[str, str], hw: HardwareConfig, policy: PolicyConfig, *,
                  instances: int, devices_per_instance: int, engine_config: EngineConfig,
                  kv_bytes_per_device: int | None, api_keys: Sequence[str], limits: Limits = Limits(),
                  dtype: str | None = None, tenant_secret: bytes | None = None, host_kv_bytes: int | None = None,
                  max_sessions: int = 10_000, session_ttl_s: float = 3600.0, tool_call_parser: str = "auto",
                  chat_template: str | None = None, resident: bool = False, inferred_calls: int = 65_536,
                  responses_stored: int = 10_000, responses_ttl_s: float = 3600.0) -> list:
    """`instances` instance servers (FastAPI apps, not started), each an `InstanceEngine` under `policy`
    over every model of `models` (served name -> what `load_local_model` loads, or a list of names) on
    its own `devices_per_instance` devices; `app.state.backend` is its InstanceEngine. Each keeps at
    most `host_kv_bytes` of session KV in host memory (None: unbounded) and `max_sessions` sessions,
    each until idle for `session_ttl_s`; `tool_call_parser`: how every model's tool calls are read
    (`serve.tools`; auto: from its chat template); `resident`: every model keeps its own device arrays
    (`Instance`'s, for a CPU); `inferred_calls`: calls kept to infer the sessions of calls that name
    none (`build_app`); `responses_stored`, `responses_ttl_s`: the Responses API's stored responses of
    each instance (`serve.responses.Store`)."""
    insts = build_instances(models, hw, instances=instances, devices_per_instance=devices_per_instance,
                            engine_config=engine_config, tokens=None, kv_bytes_per_device=kv_bytes_per_device,
                            dtype=dtype, host_kv_bytes=host_kv_bytes, resident=resident)
    apps = []
    for inst in insts:
        ie = InstanceEngine(inst, policy, session_ttl_s=session_ttl_s, max_sessions=max_sessions)
        served = [ServedModel(m, ie.engine_of(m), tool_call_parser, chat_template) for m in ie.models]
        a = build_app(served, api_keys=api_keys, limits=limits, tenant_secret=tenant_secret, backend=ie,
                      inferred_calls=inferred_calls, response_store=Store(responses_stored, responses_ttl_s))
        a.state.backend = ie
        apps.append(a)
    return apps


class LocalCluster:
    """See the module docstring: the instance servers `apps` (`instance_apps`), which take
    `api_keys`, started. Close it (or use it as a context manager) to stop them."""

    @classmethod
    def build(cls, models: Sequence[str] | Mapping[str, str], hw: HardwareConfig, policy: PolicyConfig, *,
              api_keys: Sequence[str], **kw) -> "LocalCluster":
        """The cluster of `instance_apps(models, hw, policy, api_keys=api_keys, **kw)`."""
        return cls(instance_apps(models, hw, policy, api_keys=api_keys, **kw), api_keys)

    def __init__(self, apps: Sequence, api_keys: Sequence[str]):
        self.api_keys = list(api_keys)
        self.apps = list(apps)
        self.engines = [a.state.backend for a in self.apps]
        self.stats: dict[str, dict] = {}
        self.servers = []
        self.urls = []
        for a in self.apps:
            url, server = serve_in_thread(a)
            self.urls.append(url)
            self.servers.append(server)

    def use(self, policy: PolicyConfig, timeout_s: float = 60.0) -> None:
        """Every instance under `policy`, emptied (waits up to `timeout_s` for calls in flight)."""
        for a, ie in zip(self.apps, self.engines):
            ae = a.state.engine
            deadline = time.monotonic() + timeout_s
            while ae.num_in_flight() and time.monotonic() < deadline:
                time.sleep(0.02)
            with ae.locked():
                ie.reset(policy)

    @contextlib.contextmanager
    def gateway(self, policy: PolicyConfig, **gateway_kw) -> Iterator[str]:
        """A gateway under `policy` over the instances (put under it first); yields its base URL."""
        self.use(policy)
        self.router = build_gateway(self.urls, api_keys=self.api_keys, policy=policy, **gateway_kw)
        url, server = serve_in_thread(self.router)
        try:
            yield url
        finally:
            server.should_exit = True
            server.thread.join(timeout=30)

    def compare(self, policies: Sequence[PolicyConfig], sessions: Sequence[AgentSession], *, runs: int = 1,
                on_run: Callable[[str, int, list[SessionResult]], object] | None = None,
                **run_kw) -> dict[str, list[list[SessionResult]]]:
        """The same agent sessions through a gateway under each policy in turn (`load.run_sessions`,
        whose arguments `run_kw` are), `runs` times, interleaved (p1, p2, p1, p2, ...) so that a drift
        of the machine's load falls on every policy alike; each policy's results per run.
        `on_run(policy, run, results)` is called after each. `self.stats[policy]`: the instances'
        model switches, switch seconds and KV tokens restored from host and recomputed, summed over
        its last run."""
        out: dict[str, list[list[SessionResult]]] = {p.name: [] for p in policies}
        for k in range(runs):
            for policy in policies:
                with self.gateway(policy) as url:
                    res = run_sessions(url, self.api_keys[0], sessions, **run_kw)
                out[policy.name].append(res)
                st = [ie.instance.stats for ie in self.engines]
                self.stats[policy.name] = {"switches": sum(s.switches for s in st),
                                           "switch_s": sum(s.switch_s for s in st),
                                           "restored_tokens": sum(s.restored_tokens for s in st),
                                           "recomputed_tokens": sum(s.recomputed_tokens for s in st)}
                if on_run is not None:
                    on_run(policy.name, k, res)
        return out

    def close(self) -> None:
        for server in self.servers:
            server.should_exit = True
        for server, a in zip(self.servers, self.apps):
            server.thread.join(timeout=30)
            a.state.engine.close()

    def __enter__(self) -> "LocalCluster":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


MODELS = ("smollm2-135m-instruct", "tiny-dense", "tiny-moe")
RANDOM = {"tiny-dense", "tiny-moe"}  # random weights: their replies are noise
KEY = "sk-demo"


def demo_cluster(policy: str) -> LocalCluster:
    """`make demo`'s and `benchmarks/serve_load.py`'s cluster: two local instances (one device each)
    hosting `MODELS` under `policy`, with the compilation cache on (the second instance loads what the
    first compiled), every model resident in its own arrays (`Instance`'s `resident`: a step over a
    weight slot copies every parameter on a CPU). Call it before JAX starts (it asks for two CPU devices). Programs compile as step
    shapes first occur (warming every shape of 3 models x 2 instances up front takes minutes here and
    more executables than a CPU process maps)."""
    pol = get_policy(policy)  # a bad name fails before anything starts
    simulate_cpu_devices(2)
    enable_compilation_cache()
    cfg = EngineConfig(page_size=16, max_seqs=8, max_tokens_per_step=256, max_model_len=4096, prefix_cache=True,
                       warmup=False)
    return LocalCluster.build(MODELS, load_hardware("cpu"), pol, api_keys=[KEY], instances=2, devices_per_instance=1,
                              engine_config=cfg, kv_bytes_per_device=LOCAL_KV_BYTES, resident=True)


def demo_sessions(sessions: int, calls: int, *, max_tokens: int, tool_gap_s: float, seed: int) -> list[AgentSession]:
    """Scripted agent sessions over `MODELS` (`load.agent_sessions`; SmolLM2's as chats)."""
    return agent_sessions(sessions, calls, MODELS, chat_models={MODELS[0]}, seed=seed, max_tokens=max_tokens,
                          tool_gap_s=tool_gap_s)
