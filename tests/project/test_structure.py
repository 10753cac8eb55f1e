"""The code keeps its structure (DESIGN §3, §8): packages in layers without cycles and no file circles, lazy imports
included; the replay-log cursor written by its owner only; the engine loop small."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

from deltaspec.cache.replay import ReplayCursor

ROOT = Path(__file__).resolve().parents[2] / "deltaspec"
# Lowest first. A module may import from its own package and from packages before it, never after it.
LAYERS = (
    "errors",
    "provenance",
    "config",
    "parallel",
    "ops",
    "cache",
    "model",
    "sample",
    "execution",
    "spec",
    "engine",
    "outputs",
    "llm",
    "evaluate",
    "evaluate_kl",
    "quantize",
    "server",
    "bench",
    "cli",
    "__init__",
)
CURSOR_FIELDS = {"pending_fold", "logged", "fold_rows"}


def package_of(module: str) -> str:
    """'deltaspec.engine.engine' -> 'engine'; 'deltaspec.llm' -> 'llm'; 'deltaspec' -> '__init__'."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else "__init__"


def imported_modules(source: str) -> list[tuple[int, str]]:
    """(line, module) of every deltaspec import in `source`, at any depth (functions included)."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.ImportFrom) and node.level:
            found.append((node.lineno, "relative import"))
        elif isinstance(node, ast.ImportFrom) and node.module:
            found.append((node.lineno, node.module))
        elif isinstance(node, ast.Import):
            found.extend((node.lineno, alias.name) for alias in node.names)
    return [
        (line, module) for line, module in found if module == "relative import" or module.split(".")[0] == "deltaspec"
    ]


def layer_violations(package: str, source: str) -> list[str]:
    """Imports of `source` (a module of `package`) that reach a higher layer or a sibling package."""
    rank = LAYERS.index(package)
    bad = []
    for line, module in imported_modules(source):
        if module == "relative import":
            bad.append(f"line {line}: relative import (spell deltaspec.… in full)")
            continue
        target = package_of(module)
        if target not in LAYERS:
            bad.append(f"line {line}: {module} is in no layer")
        elif target != package and LAYERS.index(target) >= rank:
            bad.append(f"line {line}: {package} imports {module} ({target} is not below {package})")
    return bad


def modules() -> list[tuple[str, Path]]:
    out = []
    for path in sorted(ROOT.rglob("*.py")):
        parts = path.relative_to(ROOT).with_suffix("").parts
        out.append((parts[0], path))
    return out


def test_every_module_belongs_to_a_layer():
    assert {package for package, _ in modules()} <= set(LAYERS)


def test_packages_import_only_from_lower_layers():
    violations = [
        f"{path.relative_to(ROOT.parent)} {problem}"
        for package, path in modules()
        for problem in layer_violations(package, path.read_text())
    ]
    assert violations == []


def test_the_layer_check_sees_lazy_and_backward_imports():
    lazy = "def f():\n    from deltaspec.engine.engine import Engine\n    return Engine\n"
    assert layer_violations("cache", lazy) == [
        "line 2: cache imports deltaspec.engine.engine (engine is not below cache)"
    ]
    assert layer_violations("engine", "import deltaspec.cache.manager\n") == []
    assert layer_violations("spec", "from deltaspec.spec.drafter import Draft\n") == []
    assert layer_violations("server", "from deltaspec.bench import device\n")  # bench is above server
    assert layer_violations("engine", "from . import scheduler\n")


def module_name(path: Path) -> str:
    """deltaspec/engine/engine.py -> 'deltaspec.engine.engine'; deltaspec/ops/__init__.py -> 'deltaspec.ops'."""
    parts = path.relative_to(ROOT.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imported_files(source: str, known: set[str]) -> set[str]:
    """The modules of `known` that `source` imports by name, at any depth (functions included): `from P import n`
    loads module P.n where there is one, else P; `import P.Q` loads P.Q."""
    found = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.ImportFrom) and node.module and not node.level:
            for alias in node.names:
                found |= {f"{node.module}.{alias.name}" if f"{node.module}.{alias.name}" in known else node.module}
        elif isinstance(node, ast.Import):
            found |= {alias.name for alias in node.names}
    return found & known


def file_circles(sources: dict[str, str]) -> list[list[str]]:
    """The circles among modules (name -> source): each set of modules that reach one another through imports,
    sorted (Tarjan's strongly connected components of more than one module, or of one importing itself)."""
    edges = {name: imported_files(source, set(sources)) for name, source in sources.items()}
    order: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    circles = []

    def visit(name: str) -> None:
        order[name] = low[name] = len(order)
        stack.append(name)
        for target in sorted(edges[name]):
            if target not in order:
                visit(target)
                low[name] = min(low[name], low[target])
            elif target in stack:
                low[name] = min(low[name], order[target])
        if low[name] == order[name]:
            members = stack[stack.index(name) :]
            del stack[stack.index(name) :]
            if len(members) > 1 or name in edges[name]:
                circles.append(sorted(members))

    for name in sorted(edges):
        if name not in order:
            visit(name)
    return sorted(circles)


def test_no_file_imports_itself_through_a_circle():
    sources = {module_name(path): path.read_text() for _, path in modules()}
    assert file_circles(sources) == []


def test_the_circle_check_sees_lazy_imports_and_chains():
    lazy = {
        "deltaspec.a": "from deltaspec.b import f\n",
        "deltaspec.b": "def f():\n    import deltaspec.c\n",
        "deltaspec.c": "def g():\n    from deltaspec import a\n",
        "deltaspec.d": "from deltaspec.a import f\n",
    }
    assert file_circles(lazy) == [["deltaspec.a", "deltaspec.b", "deltaspec.c"]]
    lazy["deltaspec.c"] = "def g():\n    pass\n"
    assert file_circles(lazy) == []
    package = {
        "deltaspec.p": "",
        "deltaspec.p.q": "from deltaspec.p import r\n",
        "deltaspec.p.r": "import deltaspec.p.q\n",
    }
    assert file_circles(package) == [["deltaspec.p.q", "deltaspec.p.r"]]  # the submodule, not its package


def cursor_writes(source: str) -> list[int]:
    """Lines that assign to a replay-cursor field (`x.pending_fold = ...`, `x.logged += ...`)."""
    lines = []
    for node in ast.walk(ast.parse(source)):
        targets = (
            node.targets
            if isinstance(node, ast.Assign)
            else [node.target]
            if isinstance(node, (ast.AugAssign, ast.AnnAssign))
            else []
        )
        for target in targets:
            for sub in ast.walk(target):
                if isinstance(sub, ast.Attribute) and sub.attr in CURSOR_FIELDS:
                    lines.append(node.lineno)
    return lines


def test_only_the_replay_module_writes_the_cursor():
    owner = ROOT / "cache" / "replay.py"
    writers = {
        str(path.relative_to(ROOT)): lines
        for _, path in modules()
        if path != owner and (lines := cursor_writes(path.read_text()))
    }
    assert writers == {}
    assert cursor_writes(owner.read_text())  # the check does see the owner's writes
    assert cursor_writes("seq.replay.pending_fold, x = 1, 2\n") == [1]


def test_replay_cursor_transitions():
    cursor = ReplayCursor()
    cursor.after_pass(5, logged=True, verifying=True)  # the sampled token's row + 4 drafts, logged
    assert (cursor.logged, cursor.pending_fold, cursor.unfolded) == (5, 0, 5)
    assert cursor.keep(3) == 2  # the row and two accepted drafts stand, two rows dropped
    assert (cursor.logged, cursor.pending_fold) == (0, 3)
    cursor.after_pass(1, logged=True, verifying=False)  # a decode row inside a verify pass: it stands as is
    assert (cursor.logged, cursor.pending_fold) == (0, 1)
    cursor.after_pass(7, logged=False, verifying=False)  # a plain pass folds and advances the state
    assert cursor.unfolded == 0
    cursor.after_pass(2, logged=True, verifying=True)
    with pytest.raises(ValueError):
        cursor.keep(3)
    cursor.reset()
    assert cursor.unfolded == 0


def test_the_engine_loop_stays_small():
    # 250 until the tensor-parallel hooks (the executor, its step, the records of outside changes) joined it;
    # the lock-step protocol itself lives behind the executor, in engine/workers.py
    assert len((ROOT / "engine" / "engine.py").read_text().splitlines()) <= 260
