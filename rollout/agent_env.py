"""A deterministic toy agentic environment, and multi-turn trajectories of a real model recorded in it.

The workload of suffix-tree speculative decoding: agents repeat file contents, diffs and test output,
and sibling trajectories (same task, other seeds) repeat each other. Each task is a toy repository (a
module with one bug, its tests, a README) held in a dict; the agent works it through a bash-like tool:

  ls                       the files
  cat FILE                 FILE with line numbers
  edit FILE LINE NEW_TEXT  replace one line (a NEW_TEXT without indentation keeps the old line's)
  run_tests                a pytest-like report; the tests never exec model-written code: a small
                           interpreter (`_Interp`) walks the module's AST, with bounded values and steps

The reward is 1 once every test passes, which also ends the episode. `record` runs a model (the
embedded SmolLM2-135M-Instruct) through the paged `Engine`, all trajectories of all tasks as one
batch per turn, and keeps each turn's full prompt (the context the model saw) and sampled response
as token ids, so the next turn's prompt is exactly the previous prompt + response + the tool's message.

The recording the benchmarks replay is benchmarks/data/agent_trajectories.json, written by
`python -m benchmarks.record_trajectories` (`record`, then `save_trajectories`) and read with
`load_trajectories(path)`; this module holds no path of its own. `env_factory` is the same
environment as a `RolloutService.rollout` environment (benchmarks/rollout_throughput.py runs it live).
"""
from __future__ import annotations

import ast
import dataclasses
import gzip
import hashlib
import json
import operator
import pathlib
import re

MODEL = "smollm2-135m-instruct"
USAGE = "usage: ls | cat FILE | edit FILE LINE NEW_TEXT | run_tests"
MAX_OBSERVATION_CHARS = 1500  # longer tool output is cut, as agent harnesses do
MAX_MODEL_LEN = 3072  # engine context; an episode whose next turn would not fit ends ("context")
KV_BYTES = 3 * 2**30  # the engine's KV pool: ~68K tokens of SmolLM2 (fp32, 45 KiB a token), the live contexts

# ---- the toy interpreter -------------------------------------------------------------------------

_MAX_STEPS = 10_000  # AST nodes evaluated per test
_MAX_DEPTH = 50  # nested calls of module functions
_MAX_LEN = 1000  # items of a str, list or range
_MAX_INT = 10**12
_BINOPS = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: operator.truediv,
           ast.FloorDiv: operator.floordiv, ast.Mod: operator.mod}
_CMPOPS = {ast.Eq: operator.eq, ast.NotEq: operator.ne, ast.Lt: operator.lt, ast.LtE: operator.le,
           ast.Gt: operator.gt, ast.GtE: operator.ge, ast.Is: operator.is_, ast.IsNot: operator.is_not,
           ast.In: lambda a, b: a in b, ast.NotIn: lambda a, b: a not in b}
_UNARY = {ast.USub: operator.neg, ast.UAdd: operator.pos, ast.Not: operator.not_}
_STR_METHODS = frozenset({"upper", "lower", "strip", "title", "capitalize", "startswith", "endswith", "replace",
                          "split", "join", "count", "find"})


def _range(*args):
    r = range(*args)
    if len(r) > _MAX_LEN:
        raise MemoryError(f"range of {len(r)} items is over the toy runner's limit of {_MAX_LEN}")
    return r


_BUILTINS = {"len": len, "min": min, "max": max, "sum": sum, "abs": abs, "sorted": sorted, "str": str, "int": int,
             "bool": bool, "list": list, "range": _range}


def _bounded(v):
    """v, unless it is an int or sequence too large for the runner (so no edit can exhaust memory)."""
    if isinstance(v, int) and not isinstance(v, bool) and abs(v) > _MAX_INT:
        raise OverflowError(f"integer over the toy runner's limit of {_MAX_INT}")
    if isinstance(v, (str, list, tuple)) and len(v) > _MAX_LEN:
        raise MemoryError(f"{type(v).__name__} of {len(v)} items is over the toy runner's limit of {_MAX_LEN}")
    return v


def _head(node: ast.AST) -> str:
    """The first line of node's source, cut to 60 characters: a one-line error names the construct."""
    return ast.unparse(node).splitlines()[0][:60]


class _Return(Exception):
    def __init__(self, value):
        self.value = value


class ModuleError(Exception):
    """An exception raised by a statement of the module under test: where (file and line) and what."""

    def __init__(self, error: Exception, filename: str, lineno: int):
        super().__init__(f"{type(error).__name__}: {error}")
        self.error, self.filename, self.lineno = error, filename, lineno


class _Interp:
    """Evaluates the module's functions on plain values: a subset of Python (def, return, assignment,
    if, for, arithmetic, comparisons, subscripts, a few builtins and str methods) in which every value
    stays small and every run stops after `_MAX_STEPS` nodes. Nothing of the source reaches exec/eval."""

    def __init__(self, functions: dict[str, ast.FunctionDef], filename: str):
        self.functions, self.filename, self.steps, self.depth = functions, filename, 0, 0

    def call(self, name: str, args: list):
        fn = self.functions[name]
        params = [a.arg for a in fn.args.args]
        if fn.args.vararg or fn.args.kwarg or fn.args.kwonlyargs or fn.args.defaults or len(args) != len(params):
            raise TypeError(f"{name}() takes {len(params)} positional arguments but {len(args)} were given")
        if self.depth >= _MAX_DEPTH:
            raise RecursionError(f"calls nested deeper than {_MAX_DEPTH}")
        self.depth += 1
        try:
            self.run(fn.body, dict(zip(params, args)))
        except _Return as r:
            return r.value
        finally:
            self.depth -= 1
        return None

    def run(self, body: list[ast.stmt], env: dict) -> None:
        for stmt in body:
            try:
                self.stmt(stmt, env)
            except (_Return, ModuleError):
                raise
            except Exception as e:  # an error of the module's code, reported at its innermost line
                raise ModuleError(e, self.filename, stmt.lineno) from None

    def stmt(self, s: ast.stmt, env: dict) -> None:
        self.tick()
        if isinstance(s, ast.Return):
            raise _Return(None if s.value is None else self.expr(s.value, env))
        if isinstance(s, ast.Assign) and len(s.targets) == 1 and isinstance(s.targets[0], ast.Name):
            env[s.targets[0].id] = self.expr(s.value, env)
        elif isinstance(s, ast.AugAssign) and isinstance(s.target, ast.Name) and type(s.op) in _BINOPS:
            env[s.target.id] = _bounded(_BINOPS[type(s.op)](self.name(s.target.id, env), self.expr(s.value, env)))
        elif isinstance(s, ast.If):
            self.run(s.body if self.expr(s.test, env) else s.orelse, env)
        elif isinstance(s, ast.For) and isinstance(s.target, ast.Name) and not s.orelse:
            for item in _bounded(list(self.expr(s.iter, env))):
                env[s.target.id] = item
                self.run(s.body, env)
        elif isinstance(s, ast.Expr):
            self.expr(s.value, env)
        elif not isinstance(s, ast.Pass):
            raise NotImplementedError(f"the toy runner does not support this statement: {_head(s)}")

    def expr(self, e: ast.expr, env: dict):
        self.tick()
        if isinstance(e, ast.Constant) and isinstance(e.value, (int, float, str, bool, type(None))):
            return _bounded(e.value)
        if isinstance(e, ast.Name):
            return self.name(e.id, env)
        if isinstance(e, ast.BinOp) and type(e.op) in _BINOPS:
            return _bounded(_BINOPS[type(e.op)](self.expr(e.left, env), self.expr(e.right, env)))
        if isinstance(e, ast.UnaryOp) and type(e.op) in _UNARY:
            return _bounded(_UNARY[type(e.op)](self.expr(e.operand, env)))
        if isinstance(e, ast.BoolOp):
            value = None
            for v in e.values:
                value = self.expr(v, env)
                if bool(value) == isinstance(e.op, ast.Or):
                    break
            return value
        if isinstance(e, ast.Compare):
            left = self.expr(e.left, env)
            for op, right_e in zip(e.ops, e.comparators):
                right = self.expr(right_e, env)
                if not _CMPOPS[type(op)](left, right):
                    return False
                left = right
            return True
        if isinstance(e, ast.IfExp):
            return self.expr(e.body if self.expr(e.test, env) else e.orelse, env)
        if isinstance(e, (ast.List, ast.Tuple)):
            items = [self.expr(x, env) for x in e.elts]
            return _bounded(items if isinstance(e, ast.List) else tuple(items))
        if isinstance(e, ast.Subscript):
            return _bounded(self.expr(e.value, env)[self.expr(e.slice, env)])
        if isinstance(e, ast.Slice):
            return slice(*(None if x is None else self.expr(x, env) for x in (e.lower, e.upper, e.step)))
        if isinstance(e, ast.Call) and not e.keywords:
            return self.call_expr(e, env)
        raise NotImplementedError(f"the toy runner does not support this expression: {_head(e)}")

    def call_expr(self, e: ast.Call, env: dict):
        args = [self.expr(a, env) for a in e.args]
        if isinstance(e.func, ast.Name) and e.func.id in self.functions:
            return self.call(e.func.id, args)
        if isinstance(e.func, ast.Name) and e.func.id in _BUILTINS:
            return _bounded(_BUILTINS[e.func.id](*args))
        if isinstance(e.func, ast.Attribute):
            obj = self.expr(e.func.value, env)
            if not isinstance(obj, str) or e.func.attr not in _STR_METHODS:
                raise AttributeError(f"{type(obj).__name__!r} object has no attribute {e.func.attr!r} in the toy runner")
            return _bounded(getattr(obj, e.func.attr)(*args))
        raise NameError(f"name {ast.unparse(e.func)!r} is not defined")

    def name(self, name: str, env: dict):
        if name in env:
            return env[name]
        raise NameError(f"name {name!r} is not defined")

    def tick(self) -> None:
        self.steps += 1
        if self.steps > _MAX_STEPS:
            raise TimeoutError(f"stopped after {_MAX_STEPS} steps")


# ---- tasks -----------------------------------------------------------------------------------------

@dataclasses.dataclass(frozen=True)
class Task:
    """A toy repository with one bug: `module` is under test by `test_file`, `issue` is the bug report."""
    id: str
    module: str
    test_file: str
    files: dict[str, str]
    issue: str

    @property
    def instruction(self) -> str:
        return (f"{self.issue} Fix the bug in {self.module} so that the tests in {self.test_file} pass. "
                f"Files: {', '.join(sorted(self.files))}.")


def _task(id: str, module: str, source: str, tests: str, issue: str) -> Task:
    test_file = f"test_{module}"
    readme = f"# {module.removesuffix('.py')}\n\nSmall helpers, tested by {test_file}. Run the tests with run_tests.\n"
    return Task(id, module, test_file, {"README.md": readme, module: source, test_file: tests}, issue)


TASKS = {t.id: t for t in [
    _task("calc_add", "calc.py",
          'def add(a, b):\n    """The sum of a and b."""\n    return a - b\n\n\ndef sub(a, b):\n    return a - b\n',
          "from calc import add, sub\n\n\ndef test_add():\n    assert add(2, 3) == 5\n\n\n"
          "def test_add_negative():\n    assert add(-1, 1) == 0\n\n\ndef test_sub():\n    assert sub(5, 3) == 2\n",
          "add(2, 3) returns -1 instead of 5."),
    _task("text_shout", "text.py",
          'def shout(s):\n    """s in capitals, with an exclamation mark."""\n    return s.lower() + "!"\n\n\n'
          'def whisper(s):\n    return s.lower() + "..."\n',
          'from text import shout, whisper\n\n\ndef test_shout():\n    assert shout("hi") == "HI!"\n\n\n'
          'def test_whisper():\n    assert whisper("Hey") == "hey..."\n',
          'shout("hi") returns "hi!" instead of "HI!".'),
    _task("stats_mean", "stats.py",
          "def mean(xs):\n    return sum(xs) / (len(xs) - 1)\n\n\ndef spread(xs):\n    return max(xs) - min(xs)\n",
          "from stats import mean, spread\n\n\ndef test_mean():\n    assert mean([2, 4]) == 3\n\n\n"
          "def test_mean_one():\n    assert mean([5]) == 5\n\n\ndef test_spread():\n    assert spread([1, 4, 2]) == 3\n",
          "mean([5]) raises ZeroDivisionError and mean([2, 4]) is 6."),
    _task("bounds_clamp", "bounds.py",
          'def clamp(x, lo, hi):\n    """x limited to the range [lo, hi]."""\n    if x < lo:\n        return lo\n'
          "    if x > hi:\n        return lo\n    return x\n",
          "from bounds import clamp\n\n\ndef test_inside():\n    assert clamp(5, 0, 10) == 5\n\n\n"
          "def test_below():\n    assert clamp(-3, 0, 10) == 0\n\n\ndef test_above():\n    assert clamp(42, 0, 10) == 10\n",
          "clamp(42, 0, 10) returns 0 instead of 10."),
    _task("total_loop", "total.py",
          'def total(xs):\n    """The sum of the numbers in xs."""\n    s = 0\n    for i in range(len(xs) - 1):\n'
          "        s += xs[i]\n    return s\n",
          "from total import total\n\n\ndef test_three():\n    assert total([1, 2, 3]) == 6\n\n\n"
          "def test_empty():\n    assert total([]) == 0\n\n\ndef test_one():\n    assert total([7]) == 7\n",
          "total([1, 2, 3]) returns 3 instead of 6: the last number is left out."),
    _task("parity", "parity.py",
          "def is_even(n):\n    return n % 2 == 1\n\n\ndef is_odd(n):\n    return n % 2 == 1\n",
          "from parity import is_even, is_odd\n\n\ndef test_even():\n    assert is_even(4)\n\n\n"
          "def test_not_even():\n    assert not is_even(7)\n\n\ndef test_odd():\n    assert is_odd(7)\n",
          "is_even(4) is False."),
    _task("grade_boundary", "grade.py",
          'def grade(score):\n    """"pass" from 50 points up, else "fail"."""\n    if score > 50:\n        return "pass"\n'
          '    return "fail"\n',
          'from grade import grade\n\n\ndef test_pass():\n    assert grade(80) == "pass"\n\n\n'
          'def test_boundary():\n    assert grade(50) == "pass"\n\n\ndef test_fail():\n    assert grade(10) == "fail"\n',
          'grade(50) returns "fail" but 50 points should pass.'),
    _task("names_join", "names.py",
          'def full_name(first, last):\n    return first + last\n\n\ndef initials(first, last):\n'
          '    return first[0] + "." + last[0] + "."\n',
          'from names import full_name, initials\n\n\ndef test_full_name():\n'
          '    assert full_name("Ada", "Lovelace") == "Ada Lovelace"\n\n\n'
          'def test_initials():\n    assert initials("Ada", "Lovelace") == "A.L."\n',
          'full_name("Ada", "Lovelace") returns "AdaLovelace" without the space.'),
]}


# ---- the test runner ---------------------------------------------------------------------------------

def _rule(text: str, char: str) -> str:
    return f" {text} ".center(80, char) if text else char * 80


def _collect(files: dict[str, str], task: Task) -> tuple[_Interp, list[ast.FunctionDef]]:
    """The module's interpreter and the test functions; SyntaxError or ModuleError when the module does
    not load (a syntax error, a statement other than def at top level, a name the tests import missing)."""
    tree = ast.parse(files[task.module], task.module)
    functions = {}
    for node in tree.body:
        if isinstance(node, ast.FunctionDef):
            functions[node.name] = node
        elif not (isinstance(node, ast.Expr) and isinstance(node.value, ast.Constant)):
            raise ModuleError(NotImplementedError("the toy runner loads only def statements at module level"),
                              task.module, node.lineno)
    tests = ast.parse(task.files[task.test_file])  # the original tests: edits of the test file are refused
    mod = task.module.removesuffix(".py")
    for node in tests.body:
        for alias in node.names if isinstance(node, ast.ImportFrom) else ():
            if alias.name not in functions:
                raise ModuleError(ImportError(f"cannot import name {alias.name!r} from {mod!r}"),
                                  task.test_file, node.lineno)
    return _Interp(functions, task.module), [n for n in tests.body if isinstance(n, ast.FunctionDef)]


def _explain(interp: _Interp, expr: ast.expr) -> list[str] | None:
    """None if the asserted expression holds, else pytest's "E" lines: the compared values and where
    a call produced them. ModuleError when the module's code raises."""
    def where(node, value):
        return [f" +  where {value!r} = {ast.unparse(node)}"] if isinstance(node, ast.Call) else []

    if isinstance(expr, ast.Compare) and len(expr.ops) == 1:
        left, right = interp.expr(expr.left, {}), interp.expr(expr.comparators[0], {})
        if _CMPOPS[type(expr.ops[0])](left, right):
            return None
        op = ast.unparse(ast.Compare(ast.Name("a"), expr.ops, [ast.Name("b")]))[2:-2]
        return [f"assert {left!r} {op} {right!r}", *where(expr.left, left)]
    if isinstance(expr, ast.UnaryOp) and isinstance(expr.op, ast.Not):
        value = interp.expr(expr.operand, {})
        return None if not value else [f"assert not {value!r}", *where(expr.operand, value)]
    value = interp.expr(expr, {})
    return None if value else [f"assert {value!r}", *where(expr, value)]


def _run_test(interp: _Interp, test: ast.FunctionDef, files: dict[str, str], task: Task
              ) -> tuple[list[str], str] | None:
    """None if the test passes, else its FAILURES section lines and its short-summary reason."""
    for node in test.body:
        interp.steps = 0
        head = ["", f"    def {test.name}():", f">       {ast.get_source_segment(task.files[task.test_file], node)}"]
        try:
            lines = _explain(interp, node.test)
        except ModuleError as e:  # raised by the module's code: shown at its line
            return [*head, "", f"{e.filename}:{e.lineno}: in {_function_at(interp, e.lineno)}",
                    f"    {_line(files, e.filename, e.lineno)}", f"E   {e}"], str(e)
        except Exception as e:  # raised by the test's own line, e.g. a call with the wrong arguments
            reason = f"{type(e).__name__}: {e}"
            return [*head, f"E       {reason}", "", f"{task.test_file}:{node.lineno}: {type(e).__name__}"], reason
        if lines is not None:
            return [*head, *(f"E       {x}" for x in lines), "", f"{task.test_file}:{node.lineno}: AssertionError"], lines[0]
    return None


def _line(files: dict[str, str], name: str, lineno: int) -> str:
    lines = files[name].splitlines()
    return lines[lineno - 1].strip() if 1 <= lineno <= len(lines) else ""


def _function_at(interp: _Interp, lineno: int) -> str:
    return next((f.name for f in interp.functions.values() if f.lineno <= lineno <= f.end_lineno), "<module>")


def run_tests(files: dict[str, str], task: Task) -> tuple[str, bool]:
    """A pytest-like report of `task`'s tests against `files`, and whether all passed."""
    out = [_rule("test session starts", "=")]
    try:
        interp, tests = _collect(files, task)
    except (SyntaxError, ModuleError) as e:  # both name the file and line
        reason = f"{type(e).__name__}: {e.msg}" if isinstance(e, SyntaxError) else str(e)
        out += ["collected 0 items / 1 error", "", _rule("ERRORS", "="), _rule(f"ERROR collecting {task.test_file}", "_"),
                f"{e.filename}:{e.lineno}: {reason}", f"    {_line(files, e.filename, e.lineno or 0)}",
                _rule("short test summary info", "="),
                f"ERROR {task.test_file} - {reason}", _rule("1 error", "=")]
        return "\n".join(out), False
    results = [(t.name, _run_test(interp, t, files, task)) for t in tests]
    marks = "".join("." if r is None else "F" for _, r in results)
    out += [f"collected {len(tests)} item{'s' if len(tests) != 1 else ''}", "", f"{task.test_file} {marks}".ljust(73) + "[100%]"]
    failed = [(name, r) for name, r in results if r is not None]
    if failed:
        out += ["", _rule("FAILURES", "=")]
        for name, (lines, _) in failed:
            out += [_rule(name, "_"), *lines]
        out += [_rule("short test summary info", "=")]
        out += [f"FAILED {task.test_file}::{name} - {reason}" for name, (_, reason) in failed]
    passed = len(tests) - len(failed)
    counts = ", ".join(x for x in (f"{len(failed)} failed" if failed else "", f"{passed} passed" if passed else "") if x)
    out.append(_rule(counts, "="))
    return "\n".join(out), not failed


# ---- the environment ---------------------------------------------------------------------------------

@dataclasses.dataclass(frozen=True)
class EnvStep:
    output: str
    reward: float  # 1.0 when every test passes on the current files
    done: bool


class AgentEnv:
    """One episode of a task: its own copy of the files, changed only by `edit`."""

    def __init__(self, task: Task):
        self.task = task
        self.files = dict(task.files)

    def step(self, command: str) -> EnvStep:
        """Runs one tool command; anything malformed gets a one-line message, never an exception."""
        words = command.split()
        name = words[0] if words else ""
        if name == "ls" and len(words) == 1:
            output = "\n".join(sorted(self.files))
        elif name == "cat" and len(words) == 2:
            output = self.cat(words[1])
        elif name == "edit":
            output = self.edit(command)
        elif name == "run_tests" and len(words) == 1:
            output = run_tests(self.files, self.task)[0]
        elif name in ("ls", "cat", "run_tests"):
            output = USAGE
        else:
            output = f"{name or '(empty)'}: command not found; {USAGE}"
        reward = float(run_tests(self.files, self.task)[1])
        return EnvStep(output, reward, reward == 1.0)

    def cat(self, name: str) -> str:
        if name not in self.files:
            return f"cat: {name}: No such file"
        return "\n".join(f"{i:4d}  {line}" for i, line in enumerate(self.files[name].splitlines(), 1))

    def edit(self, command: str) -> str:
        """`edit FILE LINE NEW_TEXT`: replaces line LINE; the answer is the change as a one-line diff."""
        m = re.fullmatch(r"edit\s+(\S+)\s+(\d+) ?(.*)", command.strip("\n"))
        if not m:
            return "usage: edit FILE LINE NEW_TEXT"
        name, lineno, text = m.group(1), int(m.group(2)), m.group(3)
        if name not in self.files:
            return f"edit: {name}: No such file"
        if name == self.task.test_file:
            return f"edit: {name} is read-only: fix {self.task.module}"
        lines = self.files[name].splitlines()
        if not 1 <= lineno <= len(lines):
            return f"edit: line {lineno} is outside {name} (lines 1-{len(lines)})"
        old = lines[lineno - 1]
        if text and not text[0].isspace():
            text = old[:len(old) - len(old.lstrip())] + text
        lines[lineno - 1] = text
        self.files[name] = "\n".join(lines) + "\n"
        return f"--- a/{name}\n+++ b/{name}\n@@ -{lineno} +{lineno} @@\n-{old}\n+{text}"


_COMMAND = re.compile(r"(ls|cat|edit|run_tests)\b")


def parse_command(reply: str) -> str:
    """The tool command in a model reply: the first line starting with a command name (after a `$ `
    prompt or backticks), looking in fenced blocks first; else the reply's first non-empty line, which
    the tool answers with its usage line."""
    fenced = re.findall(r"```[^\n]*\n(.*?)(?:```|\Z)", reply, re.S)
    for line in [x for block in fenced for x in block.splitlines()] + reply.splitlines():
        candidate = line.strip().strip("`").removeprefix("$").strip()
        if _COMMAND.match(candidate):
            return candidate
    return next((x.strip() for x in reply.splitlines() if x.strip()), "")


SYSTEM = ("You are a coding agent in a small Python repository. You act only through commands: reply with "
          "exactly one command and nothing else.\n  ls\n  cat FILE\n  edit FILE LINE NEW_TEXT\n  run_tests\n"
          "cat numbers the lines; edit replaces line LINE of FILE with NEW_TEXT. Each command's output comes back "
          "as the next message. Read the code, fix the bug, then run the tests.")
# The worked example before every task (a 135M model follows the protocol far better after one): its
# tool messages are this environment's own output.
EXAMPLE = _task("example", "ops.py", "def double(x):\n    return x + 2\n",
                "from ops import double\n\n\ndef test_double():\n    assert double(3) == 6\n",
                "double(3) returns 5 instead of 6.")
EXAMPLE_COMMANDS = ("cat ops.py", "edit ops.py 2 return x * 2", "run_tests")


def first_messages(task: Task) -> list[dict[str, str]]:
    """The chat before the model's first turn: the system message, the worked example, the task."""
    env, messages = AgentEnv(EXAMPLE), [{"role": "system", "content": SYSTEM}]
    user = EXAMPLE.instruction
    for command in EXAMPLE_COMMANDS:
        messages += [{"role": "user", "content": user}, {"role": "assistant", "content": command}]
        user = observation(command, env.step(command).output)
    return messages + [{"role": "user", "content": f"{user}\n\nNext task. {task.instruction}"}]


def observation(command: str, output: str) -> str:
    """The tool's message to the model: a shell transcript of the command, its output cut to
    MAX_OBSERVATION_CHARS."""
    if len(output) > MAX_OBSERVATION_CHARS:
        output = f"{output[:MAX_OBSERVATION_CHARS]}\n... ({len(output) - MAX_OBSERVATION_CHARS} more characters)"
    return f"$ {command}\n{output}"


# ---- recorded trajectories ---------------------------------------------------------------------------

@dataclasses.dataclass(frozen=True)
class Turn:
    prompt: list[int]  # the full context the model saw: the previous prompt + response + the tool's message
    response: list[int]  # sampled ids, ending with the stop token when finish_reason is "stop"
    logprobs: list[float]  # of each response token
    finish_reason: str  # "stop" or "length"
    command: str  # what the tool ran
    reward: float  # after the command


@dataclasses.dataclass(frozen=True)
class Trajectory:
    task: str  # a TASKS id
    sibling: int  # index among the task's trajectories (same first prompt, other seed)
    seed: int  # sampling seed; turn t samples with seed + t
    turns: list[Turn]
    end: str  # "solved", "max_turns" or "context" (the next turn would not fit MAX_MODEL_LEN)

    @property
    def solved(self) -> bool:
        return self.end == "solved"


def load_trajectories(path: str | pathlib.Path) -> list[Trajectory]:
    """The trajectories of a recording written by `save_trajectories` at `path` (.json, or .json.gz)."""
    path = pathlib.Path(path)
    raw = gzip.decompress(path.read_bytes()) if path.suffix == ".gz" else path.read_bytes()
    return [Trajectory(t["task"], t["sibling"], t["seed"], [Turn(**u) for u in t["turns"]], t["end"])
            for t in json.loads(raw)["trajectories"]]


def save_trajectories(path: str | pathlib.Path, header: dict, trajectories: list[Trajectory]) -> int:
    """Writes header and trajectories as compact JSON (gzipped for a .gz path); returns the bytes written."""
    path = pathlib.Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    lines = ",\n".join(json.dumps(dataclasses.asdict(t), separators=(",", ":")) for t in trajectories)
    data = f'{{"header": {json.dumps(header, indent=1)},\n"trajectories": [\n{lines}\n]}}\n'.encode()
    path.write_bytes(gzip.compress(data, mtime=0) if path.suffix == ".gz" else data)
    return path.stat().st_size


def stable_seed(seed: int, task: str, sibling: int) -> int:
    """A trajectory's sampling seed, the same in every process (hash() of a str is salted per process)."""
    digest = hashlib.blake2b(f"{seed}:{task}:{sibling}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") >> 2  # room for + turn below 2**63


def first_prompt(tokenizer, task: Task) -> list[int]:
    """The token ids of a task's first turn: `first_messages` under the chat template."""
    return tokenizer.encode(tokenizer.apply_chat_template(first_messages(task), add_generation_prompt=True))


def continuation(tokenizer, response: list[int], message: str) -> list[int]:
    """The tokens after a response: the chat template's end of the assistant message and the next
    user message (the tool's `message`) with the generation prompt, without the end token the
    response already has."""
    mark = "\x00REPLY\x00"
    text = tokenizer.apply_chat_template([{"role": "system", "content": SYSTEM}, {"role": "assistant", "content": mark},
                                          {"role": "user", "content": message}], add_generation_prompt=True)
    ids = tokenizer.encode(text[text.index(mark) + len(mark):])
    return ids[1:] if response and ids and response[-1] == ids[0] else ids


def env_factory(tasks: list[Task], tokenizer):
    """`make_env` for `RolloutService.rollout` (prompt i is `first_prompt(tasks[i])`): each
    trajectory's own AgentEnv runs the command of each reply and returns the tool's message as the
    next turn's tokens, or None once the tests pass. `rewards[(i, j)]` is each trajectory's last reward."""
    rewards: dict[tuple[int, int], float] = {}

    def make_env(i: int, j: int):
        env = AgentEnv(tasks[i])
        rewards[i, j] = 0.0

        def step(completion) -> list[int] | None:
            ids = completion.token_ids
            text = tokenizer.decode(ids[:-1] if completion.finish_reason == "stop" else ids)
            command = parse_command(text)
            result = env.step(command)
            rewards[i, j] = result.reward
            return None if result.done else continuation(tokenizer, ids, observation(command, result.output))
        return step

    return make_env, rewards


class _Episode:
    """A trajectory being recorded: the environment, the next prompt, the turns so far."""

    def __init__(self, task: Task, sibling: int, seed: int, tokenizer):
        self.task, self.sibling, self.seed, self.tok = task, sibling, seed, tokenizer
        self.env = AgentEnv(task)
        self.prompt = first_prompt(tokenizer, task)
        self.turns: list[Turn] = []
        self.end: str | None = None

    def advance(self, out) -> None:
        """Records the engine's output for this turn, runs its command and builds the next prompt."""
        command = parse_command(out.text)
        result = self.env.step(command)
        response = list(out.token_ids)
        self.turns.append(Turn(self.prompt, response, [round(float(x), 4) for x in out.logprobs],
                               out.finish_reason, command, result.reward))
        if result.done:
            self.end = "solved"
        else:
            self.prompt = self.prompt + response + continuation(self.tok, response, observation(command, result.output))

    def trajectory(self) -> Trajectory:
        return Trajectory(self.task.id, self.sibling, self.seed, self.turns, self.end or "max_turns")


def record(lm, tasks: list[Task], samples: int, max_turns: int, max_tokens: int, temperature: float,
           seed: int) -> list[Trajectory]:
    """`samples` trajectories per task, all advanced one turn per `Engine.generate` batch. The prefix
    cache keeps each trajectory's context between turns, so a turn prefills only its new tokens."""
    import tqdm

    from talaria_jax.engine import Engine, EngineConfig, SamplingParams

    episodes = [_Episode(t, k, stable_seed(seed, t.id, k), lm.tokenizer) for t in tasks for k in range(samples)]
    max_len = min(lm.cfg.max_position, MAX_MODEL_LEN)
    engine = Engine(lm.model, EngineConfig(max_seqs=len(episodes), max_tokens_per_step=max(512, len(episodes)),
                                           max_model_len=max_len, kv_memory_bytes_per_device=KV_BYTES, seed=seed,
                                           warmup=False, prefix_cache=True),
                    tokenizer=lm.tokenizer)
    with tqdm.trange(max_turns, desc="turns") as bar:
        for turn in bar:
            for e in episodes:
                if e.end is None and len(e.prompt) + max_tokens > max_len:
                    e.end = "context"
            live = [e for e in episodes if e.end is None]
            if not live:
                break
            bar.set_postfix(live=len(live))
            params = [SamplingParams(max_tokens=max_tokens, temperature=temperature, seed=e.seed + turn) for e in live]
            for e, out in zip(live, engine.generate([e.prompt for e in live], params)):
                e.advance(out)
    return [e.trajectory() for e in episodes]


def summary(trajectories: list[Trajectory]) -> str:
    """One line of figures: trajectories, turns, tokens, replies that held a tool command, solved tasks."""
    turns = sum(len(t.turns) for t in trajectories)
    commands = sum(bool(_COMMAND.match(u.command)) for t in trajectories for u in t.turns)
    response = sum(len(u.response) for t in trajectories for u in t.turns)
    prompt = sum(len(u.prompt) for t in trajectories for u in t.turns)
    solved = sorted({t.task for t in trajectories if t.solved})
    return (f"{len(trajectories)} trajectories, {turns} turns ({commands} with a tool command), {response} response "
            f"tokens, {prompt} prompt tokens (summed over turns); solved {sum(t.solved for t in trajectories)} "
            f"({', '.join(solved) or 'none'})")

