"""The package as a new user installs it: the wheel built from a copy of the source, installed with its
dependencies into a fresh virtualenv outside the checkout, and its tools run from a folder that is not
the checkout: `talaria-replay` on its default trace and `talaria-generate` on a tiny model. What the
tools read (model configs, hardware profiles, traces) must come with the wheel."""
import pathlib
import shutil
import subprocess
import sys

import pytest

pytestmark = pytest.mark.slow  # a wheel built and installed with its dependencies (pip's cache, or the index)
ROOT = pathlib.Path(__file__).resolve().parents[2]
LEFT_OUT = (".git", ".venv", "site", "build", "dist", "*.egg-info", "__pycache__", ".pytest_cache", "tests", "docs")


def run(args, cwd, timeout=600) -> subprocess.CompletedProcess:
    p = subprocess.run([str(a) for a in args], cwd=cwd, capture_output=True, text=True, timeout=timeout)
    assert p.returncode == 0, f"{' '.join(map(str, args))} exited {p.returncode}:\n{p.stdout[-3000:]}\n{p.stderr[-3000:]}"
    return p


@pytest.mark.timeout(1500)  # (the install of jax, flax, orbax and the rest, from pip's cache or the index)
def test_the_wheel_installed_outside_the_checkout_runs_replay_and_generate(tmp_path):
    src = tmp_path / "src"  # (a copy: the build writes its folders beside the sources)
    shutil.copytree(ROOT, src, ignore=shutil.ignore_patterns(*LEFT_OUT))
    run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "-w", tmp_path / "dist", src],
        tmp_path)
    wheel, = (tmp_path / "dist").glob("talaria_jax-*.whl")
    venv = tmp_path / "venv"
    run([sys.executable, "-m", "venv", venv], tmp_path)
    run([venv / "bin" / "python", "-m", "pip", "install", "-q", wheel], tmp_path)
    away = tmp_path / "elsewhere"
    away.mkdir()
    where = run([venv / "bin" / "python", "-c", "import talaria_jax.config_io as c; print(c.CONFIG_DIR)"], away)
    assert pathlib.Path(where.stdout.strip()).is_relative_to(venv)  # the installed copy, not the checkout

    p = run([venv / "bin" / "talaria-replay", "--policies=talaria,round", "--seeds=0"], away)
    out = p.stdout + p.stderr
    assert "talaria" in out and "round" in out and "sct" in out.lower(), out[-2000:]
    p = run([venv / "bin" / "talaria-generate", "--model=tiny-dense", "--prompt=Hello, agent", "--max_tokens=4",
             "--max_model_len=64"], away)
    out = p.stdout + p.stderr
    assert "Hello, agent" in out, out[-2000:]
