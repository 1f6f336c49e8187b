"""Request path: the CPU the gateway and its instances spend per call outside the model step, and the
server's detokenization of a streamed output, for this checkout and a baseline commit side by side.

    python -m benchmarks.request_path                   # baseline: main at 9948464, from a git worktree
    python -m benchmarks.request_path --calls=20 --instances=1,4,16 --baseline_ref=<commit>
    python -m benchmarks.request_path --inference --instances=1,4   # sessions named vs inferred

Per call: the next turn of one of two agent sessions (a chat completion whose conversation grows by a
tool call and its result each turn, from about 15,000 prompt tokens of SmolLM2's tokenizer: a
mid-session context, as agent sessions start at 2-6K tokens and reach about 27K on average by their
deepest turn; one output token) through `talaria-route`'s gateway over K in-process instance servers,
each a 2-layer random model with SmolLM2's tokenizer and chat template (so rendering and tokenizing
cost what they cost with the real model, and the model step is small: each turn prefills only what
it adds, the rest is in the prefix cache). The CPU counted is that of every
Python thread of the gateway and the instance servers (event loops, their worker threads) between the
first and the last call, read from /proc per thread: the engine threads ("talaria-engine"), XLA's own
threads and the client's are left out. Detokenization: a `_Choice` of the instance server fed the
outputs the engine hands out, one token at a time, for 256, 1,024 and 4,096 tokens of text.

Each version runs in its own process (the baseline from its worktree), K and versions interleaved,
best of `--repeats`. Prints a table and writes JSON (`--out`).
"""
from __future__ import annotations

import json
import os
import pathlib
import subprocess
import sys
import tempfile
import time

from benchmarks import common

ROOT = pathlib.Path(__file__).resolve().parents[1]
MAX_LEN = 24576  # the instances' context
KEY = "bench-key"
SUBPACKAGES = ("sharding", "kvcache", "scheduler", "rollout")  # pyproject's package-dir mapping


# ---- the child: one version, one K --------------------------------------------------------------
EXCHANGES = 40  # tool calls and results in the conversation: about 15,000 tokens


def conversation(turn: int, exchanges: int = EXCHANGES) -> list[dict]:
    """An agent session's history: a task, then tool calls and their (code-like) results."""
    import random

    rng = random.Random(turn)
    words = ["def", "return", "self", "config", "request", "engine", "tokens", "assert", "import", "value",
             "page", "cache", "session", "model", "error", "None", "True", "len", "range", "yield"]
    msgs = [{"role": "system", "content": "You are a coding agent. Use the tools to inspect and fix the repository."},
            {"role": "user", "content": f"Task {turn}: the test suite fails in module_{turn}.py; find and fix the bug."}]
    for k in range(exchanges):
        code = "\n".join(" ".join(rng.choice(words) for _ in range(rng.randrange(4, 12))) for _ in range(40))
        msgs.append({"role": "assistant", "content": f"Let me look at file_{k}.py.\n```bash\ncat file_{k}.py\n```"})
        msgs.append({"role": "user", "content": f"<output>\n{code}\n</output>"})
    return msgs


def thread_cpu(exclude: set[int]) -> float:
    """CPU seconds of this process's Python threads but `exclude` (native ids)."""
    import threading

    total = 0.0
    tick = os.sysconf("SC_CLK_TCK")
    for t in threading.enumerate():
        if t.native_id in exclude:
            continue
        try:
            fields = pathlib.Path(f"/proc/self/task/{t.native_id}/stat").read_text().rsplit(")", 1)[1].split()
        except FileNotFoundError:
            continue
        total += (int(fields[11]) + int(fields[12])) / tick  # utime, stime
    return total


def child_path(k: int, calls: int, model: str, named: bool = True) -> dict:
    import threading

    import httpx

    from talaria_jax.engine.engine import EngineConfig
    from talaria_jax.scheduler.policies import get_policy
    from talaria_jax.serve.app import serve_in_thread
    from talaria_jax.serve.gateway import build_gateway
    from talaria_jax.serve.config import InstanceConfig, ServerConfig
    from talaria_jax.serve.local_cluster import instance_apps

    policy = get_policy("talaria")
    # few step shapes (buckets up to 128 tokens, query tiles of one token): 16 instances' programs in one
    # process stay under vm.max_map_count (XLA:CPU maps ~3 regions per compiled kernel)
    cfg = EngineConfig(page_size=16, max_seqs=2, max_tokens_per_step=128, query_tile=1, max_model_len=MAX_LEN)
    apps = instance_apps(InstanceConfig({"m": model}, ServerConfig((KEY,)), cfg, hardware="cpu"), instances=k)
    servers = [serve_in_thread(a) for a in apps]
    url, gw = serve_in_thread(build_gateway([u for u, _ in servers], api_keys=[KEY], policy=policy))
    client = httpx.Client(base_url=url, headers={"Authorization": f"Bearer {KEY}"}, timeout=600)

    def call(session: int, turn: int) -> dict:
        r = client.post("/v1/chat/completions", json={"model": "m", "messages": conversation(session, EXCHANGES + turn),
                                                      "max_tokens": 1, "temperature": 0},
                        headers={"x-session-id": f"s{session}"} if named else {})
        r.raise_for_status()
        return r.json()

    for turn in range(2):  # warm: each session's first turn prefills it whole; nothing compiles later
        for session in range(2):
            call(session, turn)
    exclude = {threading.main_thread().native_id} | {t.native_id for t in threading.enumerate()
                                                     if t.name == "talaria-engine"}
    c0, t0 = thread_cpu(exclude), time.perf_counter()
    prompt_tokens = 0
    for i in range(calls):
        prompt_tokens += call(i % 2, 2 + i // 2)["usage"]["prompt_tokens"]
    cpu, wall = thread_cpu(exclude) - c0, time.perf_counter() - t0
    gw.should_exit = True
    for _, s in servers:
        s.should_exit = True
    return {"cpu_ms_per_call": 1e3 * cpu / calls, "wall_ms_per_call": 1e3 * wall / calls,
            "prompt_tokens": prompt_tokens / calls}


def child_detok(lengths: list[int], model: str) -> dict:
    import asyncio

    from talaria_jax.engine.engine import RequestOutput
    from talaria_jax.serve import app, protocol
    from talaria_jax.tokenizer import load_tokenizer

    tok = load_tokenizer(model)
    text = " ".join(m["content"] for m in conversation(7))
    ids = tok.encode(text)
    p = protocol.parse_chat({"model": "m", "messages": [{"role": "user", "content": "hi"}], "stream": True},
                            protocol.Limits())
    out = {}
    for n in lengths:
        best = float("inf")
        for _ in range(3):
            # what the engine hands out at each step, built before the clock starts (and for each
            # repeat: an output caches its decoded text): the engine thread's copies are not the
            # server's detokenization, and building n-sized lists inside the timed loop would put
            # them through the CPU caches between the updates it times
            outs = []
            for i in range(1, n + 1):
                prefix = ids[:i]
                outs.append(RequestOutput("r", (1,), prefix, [0.0] * i, [], "length" if i == n else None,
                                          [ids[i - 1]], prefix, tok))
            c = app._Choice(0, "r", asyncio.Queue(), p, tok)
            t0 = time.perf_counter()
            for o in outs:
                c.update(o)
                c.delta()
            best = min(best, time.perf_counter() - t0)
            assert c.text == tok.decode(ids[:n]), "the detokenized text differs from the whole decode"
            del outs
        out[str(n)] = 1e3 * best
    return out


def child(args: dict) -> None:
    os.environ["XLA_FLAGS"] = f"--xla_force_host_platform_device_count={args.get('k', 1)}"
    os.environ["JAX_PLATFORMS"] = "cpu"
    sys.path.insert(0, args["root"])
    from talaria_jax.engine import enable_compilation_cache

    enable_compilation_cache(args["cache"])
    if args["what"] == "path":
        res = child_path(args["k"], args["calls"], args["model"], args.get("named", True))
    else:
        res = child_detok(args["lengths"], args["model"])
    print("RESULT " + json.dumps(res), flush=True)


# ---- the parent ---------------------------------------------------------------------------------
def make_model(folder: pathlib.Path) -> str:
    """A 2-layer random model with SmolLM2's vocabulary, tokenizer and chat template (Orbax folder)."""
    if (folder / "params").exists():
        return str(folder)
    from talaria_jax.models.config import load_model_config
    from talaria_jax.models.model import init_model
    from talaria_jax.tokenizer import load_tokenizer
    from talaria_jax.weights import save
    from talaria_jax.weights.named import named_model_path

    tok = load_tokenizer(named_model_path("smollm2-135m-instruct"))
    cfg = load_model_config("tiny-dense").replace(name="path-bench", vocab_size=tok.vocab_size, num_layers=2,
                                                  max_position=MAX_LEN, bos_token_id=tok.bos_id,
                                                  eos_token_id=tok.eos_id)
    save(init_model(cfg, None, seed=0), folder, tokenizer=tok)
    return str(folder)


def baseline_tree(ref: str, where: pathlib.Path) -> pathlib.Path:
    """A worktree of `ref` whose talaria_jax finds its own sub-packages first (symlinks, untracked)."""
    tree = where / f"baseline-{ref}"
    if not tree.exists():
        subprocess.run(["git", "-C", str(ROOT), "worktree", "add", "--detach", str(tree), ref], check=True,
                       capture_output=True)
    for sub in SUBPACKAGES:
        link = tree / "talaria_jax" / sub
        if not link.exists():
            link.symlink_to(f"../{sub}")
    return tree


def run_child(args: dict) -> dict:
    r = subprocess.run([sys.executable, "-m", "benchmarks.request_path", "--child", json.dumps(args)], cwd=ROOT,
                       capture_output=True, text=True, timeout=3600)
    line = next((ln for ln in r.stdout.splitlines() if ln.startswith("RESULT ")), None)
    if line is None:
        raise RuntimeError(f"child {args['what']} k={args.get('k')} at {args['root']} failed:\n{r.stderr[-4000:]}")
    return json.loads(line[7:])


def main() -> None:
    from absl import app, flags

    flags.DEFINE_string("baseline_ref", "9948464", "the commit to compare with (checked out in a git worktree)")
    flags.DEFINE_bool("inference", False, "compare, in this checkout, sessions named by x-session-id with the same "
                      "calls sending none (their sessions inferred at the gateway) instead of a baseline commit")
    flags.DEFINE_list("instances", ["1", "4", "16"], "instance counts K")
    flags.DEFINE_integer("calls", 10, "calls measured per run")
    flags.DEFINE_integer("repeats", 2, "runs per version and K (best kept)")
    flags.DEFINE_list("lengths", ["256", "1024", "4096"], "output lengths for detokenization")
    flags.DEFINE_string("work", os.path.join(tempfile.gettempdir(), "talaria-request-path"), "model, cache, worktree")
    flags.DEFINE_string("out", "request_path.json", "JSON results")
    FLAGS = flags.FLAGS

    def run(argv):
        work = pathlib.Path(FLAGS.work)
        work.mkdir(parents=True, exist_ok=True)
        model = make_model(work / "model")
        if FLAGS.inference:  # (name: root, sessions named)
            roots = {"named": (str(ROOT), True), "inferred": (str(ROOT), False)}
        else:
            roots = {FLAGS.baseline_ref: (str(baseline_tree(FLAGS.baseline_ref, work)), True),
                     "this": (str(ROOT), True)}
        base, this = list(roots)
        cache = str(work / "xla")
        load = os.getloadavg()
        print(f"load average before: {load[0]:.2f}; {os.cpu_count()} CPUs", flush=True)
        res: dict = {"path": {}, "detok": {}, "load_before": load[0], "baseline": base}
        lengths = [int(n) for n in FLAGS.lengths] if not FLAGS.inference else []
        for rep in range(FLAGS.repeats):
            for name, (root, _) in roots.items():
                if not lengths:
                    break
                d = run_child({"what": "detok", "root": root, "model": model, "cache": cache, "lengths": lengths})
                prev = res["detok"].get(name)
                res["detok"][name] = d if prev is None else {n: min(prev[n], d[n]) for n in d}
            for k in (int(x) for x in FLAGS.instances):
                for name, (root, named) in roots.items():
                    r = run_child({"what": "path", "root": root, "k": k, "calls": FLAGS.calls, "model": model,
                                   "cache": cache, "named": named})
                    prev = res["path"].setdefault(str(k), {}).get(name)
                    if prev is None or r["cpu_ms_per_call"] < prev["cpu_ms_per_call"]:
                        res["path"][str(k)][name] = r
                    print(f"rep {rep} K={k} {name}: {r['cpu_ms_per_call']:.1f} ms CPU per call "
                          f"({r['wall_ms_per_call']:.0f} ms wall, {r['prompt_tokens']:.0f} prompt tokens)", flush=True)
        res["load_after"] = os.getloadavg()[0]
        print(f"\nCPU per call outside the model step (gateway + instances), ms, best of {FLAGS.repeats}:")
        print(common.markdown_header(["K", base, this, f"{this} / {base}"]))
        for k, row in res["path"].items():
            a, b = row[base]["cpu_ms_per_call"], row[this]["cpu_ms_per_call"]
            print(f"| {k} | {a:.1f} | {b:.1f} | {b / a:.2f} |")
        print(f"load average after: {res['load_after']:.2f}")
        common.write_json(FLAGS.out, res)
        if FLAGS.inference:
            return
        print("\nDetokenizing a streamed output, ms (one token per step):")
        print(common.markdown_header(["tokens", base, "this", f"this / {base}"]))
        for n in FLAGS.lengths:
            a, b = res["detok"][base][n], res["detok"]["this"][n]
            print(f"| {n} | {a:.1f} | {b:.1f} | {b / a:.3f} |")
        for name in roots:
            d = res["detok"][name]
            print(f"{name}: {FLAGS.lengths[-1]} tokens cost {d[FLAGS.lengths[-1]] / d[FLAGS.lengths[0]]:.1f}x "
                  f"what {FLAGS.lengths[0]} do")

    app.run(run)


if __name__ == "__main__":
    if len(sys.argv) > 2 and sys.argv[1] == "--child":
        child(json.loads(sys.argv[2]))
    else:
        main()
