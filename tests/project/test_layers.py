"""Dependencies point one way: every import in the package, at module level or inside a function, goes
from a layer to one below it, in the order docs/ARCHITECTURE.md gives, and no modules of one layer
import each other in a cycle. And a module uses only what others make public: it reads or writes no
private (`_name`) attribute that it does not define itself, and imports no private name."""
import ast
import pathlib
import re

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]
# where each part of the talaria_jax package lives (pyproject's package-dir mapping)
PACKAGES = {"talaria_jax": ROOT / "talaria_jax", "talaria_jax.sharding": ROOT / "sharding",
            "talaria_jax.kvcache": ROOT / "kvcache", "talaria_jax.scheduler": ROOT / "scheduler",
            "talaria_jax.rollout": ROOT / "rollout", "talaria_jax.configs": ROOT / "configs"}


def documented_layers(text: str) -> list[list[str]]:
    """The layers between `<!-- layers -->` and `<!-- /layers -->`, top first: each line names the
    units of one layer (a talaria_jax sub-package or top-level module)."""
    m = re.search(r"<!-- layers -->\s*```\w*\n(.*?)```\s*<!-- /layers -->", text, re.S)
    assert m, "docs/ARCHITECTURE.md has no <!-- layers --> block"
    return [line.split() for line in m.group(1).splitlines() if line.strip()]


def modules(packages: dict[str, pathlib.Path]) -> dict[str, pathlib.Path]:
    out = {}
    for pkg, root in packages.items():
        for f in sorted(root.rglob("*.py")):
            parts = f.relative_to(root).with_suffix("").parts
            out[".".join((pkg, *parts)).removesuffix(".__init__")] = f
    return out


def imports(path: pathlib.Path, name: str, known: set[str]) -> set[str]:
    """Modules of the package that `path` (module `name`) imports anywhere in it."""
    out = set()
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                up = package.split(".")[:len(package.split(".")) - node.level + 1]
                base = ".".join(up + ([base] if base else []))
            # `from pkg import mod` imports the module pkg.mod
            targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in known else base for a in node.names]
        else:
            continue
        out |= {t for t in targets if t in known}
    return out


def unit(module: str) -> str:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else parts[0]


def violations(packages: dict[str, pathlib.Path], layers: list[list[str]]) -> list[str]:
    """Each import against the documented order, and each import cycle within a layer's units."""
    rank = {u: len(layers) - i for i, line in enumerate(layers) for u in line}
    mods = modules(packages)
    graph = {m: imports(f, m, set(mods)) for m, f in mods.items()}
    found = []
    for m, targets in sorted(graph.items()):
        if "." not in m:  # the root package's own __init__
            continue
        a = unit(m)
        if a not in rank:
            found.append(f"{m}: unit {a!r} is in no documented layer")
            continue
        for t in sorted(targets):
            b = unit(t)
            if "." not in t or a == b:
                continue
            if b not in rank:
                found.append(f"{m} imports {t}: unit {b!r} is in no documented layer")
            elif rank[b] >= rank[a]:
                found.append(f"{m} imports {t}: {a} may import only layers below it, and {b} is not below")
    # cycles among modules (a package's __init__ importing its own modules is how packages are made)
    edges = {m: {t for t in ts if not (m.startswith(t + ".") and mods[t].name == "__init__.py")}
             for m, ts in graph.items()}
    state: dict[str, int] = {}

    def visit(m: str, path: list[str]) -> None:
        state[m] = 1
        for t in sorted(edges[m]):
            if state.get(t) == 1:
                found.append("import cycle: " + " -> ".join(path[path.index(t):] + [m, t]))
            elif t not in state:
                visit(t, path + [m])
        state[m] = 2

    for m in sorted(edges):
        if m not in state:
            visit(m, [])
    return found


NAMEDTUPLE = {"_replace", "_asdict", "_fields", "_make"}  # namedtuple's public methods, underscored


def private_reads(packages: dict[str, pathlib.Path]) -> list[str]:
    """Each use of another module's private name: `x._name` (read or written) where `x` is not `self`
    or `cls` and the module defines no `_name` itself (as a function, class, variable, or attribute
    of `self` / `cls`), and each `from m import _name`."""
    found = []
    for name, path in modules(packages).items():
        tree = ast.parse(path.read_text())
        own = set(NAMEDTUPLE)
        mine = lambda n: isinstance(n.value, ast.Name) and n.value.id in ("self", "cls")  # noqa: E731
        for node in ast.walk(tree):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                own.add(node.name)
            elif isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store) and mine(node):
                own.add(node.attr)
            elif isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
                own.add(node.id)
        for node in ast.walk(tree):
            private = lambda n: n.startswith("_") and not n.startswith("__")  # noqa: E731
            if isinstance(node, ast.Attribute) and private(node.attr) and node.attr not in own and not mine(node):
                found.append(f"{name}:{node.lineno} uses {ast.unparse(node)}")
            elif isinstance(node, ast.ImportFrom):
                found += [f"{name}:{node.lineno} imports {a.name} from {node.module}" for a in node.names
                          if private(a.name)]
    return found


def test_imports_follow_the_documented_layers():
    layers = documented_layers((ROOT / "docs" / "ARCHITECTURE.md").read_text())
    assert violations(PACKAGES, layers) == []


def test_no_module_reads_another_modules_private_names():
    assert private_reads(PACKAGES) == []


def write(root: pathlib.Path, files: dict[str, str]) -> None:
    for rel, text in files.items():
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_text(text)


@pytest.mark.parametrize("plant, expect", [
    ({"pkg/low/b.py": "def f():\n    from pkg.high import a\n"}, "pkg.low.b imports pkg.high.a: low may import"),
    ({"pkg/low/b.py": "from pkg.low import c\n", "pkg/low/c.py": "from . import b\n"}, "import cycle: pkg.low.b"),
    ({"pkg/other.py": "import pkg.low\n"}, "unit 'other' is in no documented layer"),
])
def test_a_planted_upward_import_or_cycle_is_found(tmp_path, plant, expect):
    base = {"pkg/__init__.py": "", "pkg/high/__init__.py": "", "pkg/high/a.py": "from pkg.low import b\n",
            "pkg/low/__init__.py": "from pkg.low.b import f\n", "pkg/low/b.py": "def f():\n    pass\n"}
    write(tmp_path, base)
    layers = [["high"], ["low"]]
    assert violations({"pkg": tmp_path / "pkg"}, layers) == []
    write(tmp_path, plant)
    found = violations({"pkg": tmp_path / "pkg"}, layers)
    assert any(expect in v for v in found), found


@pytest.mark.parametrize("plant, expect", [
    ("from pkg.low.b import Pool\n\ndef f(pool: Pool):\n    return pool._free\n", "pkg.high.a:4 uses pool._free"),
    ("from pkg.low.b import _helper\n", "pkg.high.a:1 imports _helper from pkg.low.b"),
    ("import pkg.low.b\n\nx = pkg.low.b._helper()\n", "pkg.high.a:3 uses pkg.low.b._helper"),
    ("from pkg.low.b import Pool\n\ndef f(pool: Pool):\n    pool._free = []\n", "pkg.high.a:4 uses pool._free"),
])
def test_a_planted_private_read_is_found(tmp_path, plant, expect):
    base = {"pkg/__init__.py": "", "pkg/high/__init__.py": "", "pkg/high/a.py": "from pkg.low.b import Pool\n",
            "pkg/low/__init__.py": "", "pkg/low/b.py": ("class Pool:\n    def __init__(self):\n        self._free = []\n"
                                                      "\n    def same(self, other):\n        return other._free\n"
                                                      "\n\ndef _helper():\n    pass\n")}
    write(tmp_path, base)
    assert private_reads({"pkg": tmp_path / "pkg"}) == []  # (a class reading its own kind's private: allowed)
    write(tmp_path, {"pkg/high/a.py": plant})
    assert expect in private_reads({"pkg": tmp_path / "pkg"})
