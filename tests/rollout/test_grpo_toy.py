"""examples/grpo_toy.py: the GRPO loop on the rollout service learns, end to end, in a child process."""
import pathlib
import re
import subprocess
import sys

import numpy as np
import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "examples"))

import grpo_toy  # noqa: E402

pytestmark = pytest.mark.slow  # real servers, SmolLM2 or child processes: not in the fast subset


def test_reward_and_advantages():
    assert grpo_toy.reward([ord("4"), ord("2"), 257], "stop") == 1.0
    assert grpo_toy.reward([ord("4"), ord("x")], "length") == 0.5 and grpo_toy.reward([257], "stop") == 0.0
    adv = grpo_toy.group_advantages(np.array([[0.0, 1.0], [0.5, 0.5]]))
    np.testing.assert_allclose(adv, [[-1, 1], [0, 0]], atol=1e-5)


def test_the_batch_aligns_each_answer_token_with_its_logprob_and_advantage():
    from talaria_jax.rollout.replica import Completion

    groups = [[Completion("a", [7, 8], [-0.5, -0.25], "length"), Completion("b", [9], [-1.0], "length")]]
    tokens, positions, mask, old_lp, adv = grpo_toy.batch([[1, 2, 3]], groups, np.array([[2.0, -2.0]]))
    assert tokens.tolist() == [[1, 2, 3, 7, 8], [1, 2, 3, 9, 0]] and positions[1].tolist() == [0, 1, 2, 3, -1]
    assert mask.tolist() == [[0, 0, 1, 1], [0, 0, 1, 0]]  # logits at 2 predict the first answer token
    assert old_lp[0].tolist() == [0, 0, -0.5, -0.25] and adv[1].tolist() == [0, 0, -2, 0]


def test_the_example_learns(tmp_path):
    out = subprocess.run([sys.executable, str(ROOT / "examples" / "grpo_toy.py"), "--steps=6",
                          "--devices_per_replica=1", f"--plot={tmp_path / 'curve.png'}"],
                         capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-2000:]
    first, last = map(float, re.search(r"first 3 steps ([\d.]+) -> last 3 steps ([\d.]+)", out.stdout).groups())
    assert last > 2 * first, out.stdout
    drifts = [float(x) for x in re.findall(r"trainer logprob\| ([\d.e+-]+)", out.stdout)]
    assert len(drifts) == 6 and max(drifts) < 1e-4  # the service's logprobs are the trainer's
    assert (tmp_path / "curve.png").stat().st_size > 1000
