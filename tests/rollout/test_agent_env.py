"""The toy agentic environment of talaria_jax.rollout.agent_env (tool commands, the test runner, the
reward) and its recorded trajectories in benchmarks/data (well-formed token streams). No model runs here."""
import json
import pathlib
import time

import pytest

from talaria_jax.rollout import agent_env

TRAJECTORIES = pathlib.Path(__file__).resolve().parents[2] / "benchmarks" / "data" / "agent_trajectories.json"
VOCAB = 49152  # SmolLM2's vocabulary
USER_TURN = [198, 1, 4093, 198]  # "\n<|im_start|>user\n" after the <|im_end|> (2) that closes a reply
ASSISTANT_TURN = [2, 198, 1, 520, 9531, 198]  # "<|im_end|>\n<|im_start|>assistant\n"

# A one-line fix of each task's bug, as the agent would write it.
FIXES = {"calc_add": "edit calc.py 3 return a + b", "text_shout": "edit text.py 3 return s.upper() + '!'",
         "stats_mean": "edit stats.py 2 return sum(xs) / len(xs)", "bounds_clamp": "edit bounds.py 6         return hi",
         "total_loop": "edit total.py 4 for i in range(len(xs)):", "parity": "edit parity.py 2 return n % 2 == 0",
         "grade_boundary": "edit grade.py 3 if score >= 50:",
         "names_join": 'edit names.py 2 return first + " " + last'}


def calc_env():
    return agent_env.AgentEnv(agent_env.TASKS["calc_add"])


def test_ls_and_cat():
    env = calc_env()
    assert env.step("ls").output == "README.md\ncalc.py\ntest_calc.py"
    assert env.step("cat calc.py").output == ('   1  def add(a, b):\n   2      """The sum of a and b."""\n'
                                              "   3      return a - b\n   4  \n   5  \n   6  def sub(a, b):\n"
                                              "   7      return a - b")
    assert env.step("cat nope.py").output == "cat: nope.py: No such file"


def test_run_tests_reports_the_failing_assertion():
    result = calc_env().step("run_tests")
    assert (result.reward, result.done) == (0.0, False)
    lines = result.output.splitlines()
    assert lines[1:4] == ["collected 3 items", "", "test_calc.py FF.".ljust(73) + "[100%]"]
    for expected in (">       assert add(2, 3) == 5", "E       assert -1 == 5", "E        +  where -1 = add(2, 3)",
                     "test_calc.py:5: AssertionError", "FAILED test_calc.py::test_add - assert -1 == 5"):
        assert expected in lines
    assert lines[-1] == " 2 failed, 1 passed ".center(80, "=")


def test_an_exception_in_the_module_is_shown_at_its_line():
    out = agent_env.AgentEnv(agent_env.TASKS["stats_mean"]).step("run_tests").output.splitlines()
    i = out.index("stats.py:2: in mean")
    assert out[i + 1:i + 3] == ["    return sum(xs) / (len(xs) - 1)", "E   ZeroDivisionError: division by zero"]


def test_edit_fixes_the_bug_and_gives_reward_1():
    env = calc_env()
    result = env.step("edit calc.py 3 return a + b")  # no indentation given: the old line's is kept
    assert result.output == "--- a/calc.py\n+++ b/calc.py\n@@ -3 +3 @@\n-    return a - b\n+    return a + b"
    assert (result.reward, result.done) == (1.0, True)
    tests = env.step("run_tests")
    assert tests.output.splitlines()[-1] == " 3 passed ".center(80, "=") and tests.reward == 1.0
    assert agent_env.TASKS["calc_add"].files["calc.py"].splitlines()[2] == "    return a - b"  # the task is untouched


@pytest.mark.parametrize("task_id", sorted(agent_env.TASKS))
def test_every_task_fails_first_and_its_fix_passes(task_id):
    env = agent_env.AgentEnv(agent_env.TASKS[task_id])
    assert env.step("run_tests").reward == 0.0
    result = env.step(FIXES[task_id])
    assert result.done, env.step("run_tests").output


def test_runs_are_deterministic():
    outputs = [[calc_env().step(c).output for c in ("ls", "cat calc.py", "run_tests", "edit calc.py 3 return b")]
               for _ in range(2)]
    assert outputs[0] == outputs[1]


@pytest.mark.parametrize("command,output", [
    ("", "(empty): command not found; " + agent_env.USAGE),
    ("rm -rf /", "rm: command not found; " + agent_env.USAGE),
    ("cat", agent_env.USAGE),
    ("ls -la", agent_env.USAGE),
    ("run_tests now", agent_env.USAGE),
    ("edit calc.py three x", "usage: edit FILE LINE NEW_TEXT"),
    ("edit calc.py 99 x", "edit: line 99 is outside calc.py (lines 1-7)"),
    ("edit nope.py 1 x", "edit: nope.py: No such file"),
    ("edit test_calc.py 5 pass", "edit: test_calc.py is read-only: fix calc.py"),
])
def test_bad_commands_get_one_line_and_change_nothing(command, output):
    env = calc_env()
    result = env.step(command)
    assert result.output == output and "\n" not in output
    assert (result.reward, result.done) == (0.0, False) and env.files == agent_env.TASKS["calc_add"].files


@pytest.mark.parametrize("line,error", [
    ("return a +", "SyntaxError: invalid syntax"),
    ("while True: pass", "NotImplementedError: the toy runner does not support this statement: while True:"),
    ("return __import__('os').system('true')", "NameError: name '__import__' is not defined"),
    ("return open('/etc/passwd').read()", "NameError: name 'open' is not defined"),
    ("return a.__class__", "NotImplementedError: the toy runner does not support this expression: a.__class__"),
    ("return 10 ** 100", "NotImplementedError: the toy runner does not support this expression: 10 ** 100"),
    ("return 'x' * 1000000", "MemoryError: str of 1000000 items is over the toy runner's limit of 1000"),
    ("return add(a, b)", "RecursionError: calls nested deeper than 50"),
    ("return add(a + 1, b) + add(a + 1, b) if a < 40 else 0", "TimeoutError: stopped after 10000 steps"),
])
def test_model_written_code_is_never_executed_and_always_bounded(line, error):
    env = calc_env()
    env.step(f"edit calc.py 3 {line}")
    t = time.perf_counter()
    result = env.step("run_tests")
    assert time.perf_counter() - t < 1.0
    assert error in result.output and result.reward == 0.0


def test_a_test_that_calls_a_removed_function_is_a_collection_error():
    env = calc_env()
    env.step("edit calc.py 1 def plus(a, b):")
    out = env.step("run_tests").output
    assert "test_calc.py:1: ImportError: cannot import name 'add' from 'calc'" in out
    assert out.splitlines()[-1] == " 1 error ".center(80, "=")


@pytest.mark.parametrize("reply,command", [
    ("cat calc.py", "cat calc.py"),
    ("Let me look first.\n```bash\n$ cat calc.py\n```", "cat calc.py"),
    ("I will run `run_tests` now.\n`run_tests`", "run_tests"),
    ("```\nedit calc.py 3     return a + b", "edit calc.py 3     return a + b"),  # a block cut by max_tokens
    ("Sure! Here is the fix:\n```python\ndef add(a, b):", "Sure! Here is the fix:"),
    ("", ""),
])
def test_parse_command(reply, command):
    assert agent_env.parse_command(reply) == command


def test_first_messages_hold_the_worked_example_then_the_task():
    messages = agent_env.first_messages(agent_env.TASKS["parity"])
    assert [m["role"] for m in messages] == ["system"] + ["user", "assistant"] * 3 + ["user"]
    assert [m["content"] for m in messages[2:7:2]] == list(agent_env.EXAMPLE_COMMANDS)
    assert messages[-1]["content"].endswith(agent_env.TASKS["parity"].instruction)
    assert " 1 passed " in messages[-1]["content"]


@pytest.fixture(scope="module")
def recording():
    return json.loads(TRAJECTORIES.read_text())["header"], agent_env.load_trajectories(TRAJECTORIES)


def test_recording_header(recording):
    header, trajectories = recording
    assert header["model"] == "smollm2-135m-instruct" and header["vocab_size"] == VOCAB
    assert header["command"].startswith("python ") and header["date"]  # the command that wrote it
    flags = header["flags"]
    assert len(trajectories) == len(flags["tasks"]) * flags["samples_per_task"]
    assert {(t.task, t.sibling) for t in trajectories} == {(task, k) for task in flags["tasks"]
                                                          for k in range(flags["samples_per_task"])}


def test_recorded_token_streams_are_well_formed(recording):
    header, trajectories = recording
    for t in trajectories:
        assert 1 <= len(t.turns) <= header["flags"]["max_turns"], (t.task, t.sibling)
        assert t.end in ("solved", "max_turns", "context") and t.solved == (t.turns[-1].reward == 1.0)
        assert t.seed == agent_env.stable_seed(header["seed"], t.task, t.sibling)
        previous = None
        for u in t.turns:
            assert all(isinstance(x, int) and 0 <= x < VOCAB for x in u.prompt + u.response)
            assert 1 <= len(u.response) <= header["flags"]["max_tokens"] and len(u.logprobs) == len(u.response)
            assert all(x <= 0 for x in u.logprobs)
            assert (u.response[-1] in header["eos_ids"]) == (u.finish_reason == "stop")
            assert u.prompt[-len(ASSISTANT_TURN):] == ASSISTANT_TURN
            if previous is not None:  # the context grows by the reply and the tool's message
                context = previous.prompt + previous.response
                assert u.prompt[:len(context)] == context
                closing = [] if previous.finish_reason == "stop" else [2]
                assert u.prompt[len(context):len(context) + len(closing) + 4] == closing + USER_TURN
            previous = u


def test_siblings_share_their_first_prompt_and_tasks_the_worked_example(recording):
    _, trajectories = recording
    first = {}
    for t in trajectories:
        first.setdefault(t.task, t.turns[0].prompt)
        assert t.turns[0].prompt == first[t.task]
    seeds = [t.seed for t in trajectories]
    assert len(set(seeds)) == len(seeds)
    prompts = list(first.values())
    shared = next(i for i, ids in enumerate(zip(*prompts)) if len(set(ids)) > 1)
    assert shared > 300  # the system message and the worked example
