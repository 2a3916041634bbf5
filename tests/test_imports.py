"""The import graph points one way (issue 13): no cycle among remat_kit modules, the library never
imports the CLI, and leaf modules import nothing from remat_kit. Read statically with ``ast``
(every import statement, at module level or inside functions), so a cycle dodged by a
function-level import still counts."""

from __future__ import annotations

import ast
import pathlib
import subprocess
import sys

import pytest

PKG = pathlib.Path(__file__).resolve().parents[1] / "remat_kit"
LEAVES = ("remat_kit.validation", "remat_kit.units")


def _module_name(path: pathlib.Path) -> str:
    parts = path.relative_to(PKG.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _modules() -> dict[str, pathlib.Path]:
    return {_module_name(p): p for p in sorted(PKG.rglob("*.py"))}


def _resolve(name: str, known: dict[str, pathlib.Path]) -> str | None:
    """The longest known module that ``name`` (a dotted import target) refers to."""
    while name:
        if name in known:
            return name
        name = name.rpartition(".")[0]
    return None


def _imports(module: str, path: pathlib.Path, known: dict[str, pathlib.Path]) -> set[str]:
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    out: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        targets: list[str] = []
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")
                anchor = anchor[: len(anchor) - node.level + 1]
                base = ".".join([*anchor, base] if base else anchor)
            targets = [f"{base}.{a.name}" for a in node.names] + [base]
        for t in targets:
            hit = _resolve(t, known)
            if hit and hit != module:
                out.add(hit)
    return out


def _graph() -> dict[str, set[str]]:
    known = _modules()
    graph = {m: _imports(m, p, known) for m, p in known.items()}
    # A submodule importing its own package's __init__ (for re-exported names) is not a cycle
    # through the package's other submodules; drop package edges from inside the package.
    for m, deps in graph.items():
        graph[m] = {
            d for d in deps if not (known[d].name == "__init__.py" and m.startswith(d + "."))
        }
    return graph


def _find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(n: str) -> list[str] | None:
        state[n] = 1
        stack.append(n)
        for d in sorted(graph.get(n, ())):
            if state.get(d) == 1:
                return stack[stack.index(d) :] + [d]
            if d not in state and (cycle := visit(d)):
                return cycle
        stack.pop()
        state[n] = 2
        return None

    for n in sorted(graph):
        if n not in state and (cycle := visit(n)):
            return cycle
    return None


def test_no_import_cycle():
    cycle = _find_cycle(_graph())
    assert cycle is None, "import cycle: " + " -> ".join(cycle)


def test_library_never_imports_the_cli():
    bad = {
        m: sorted(d for d in deps if d == "remat_kit.cli" or d.startswith("remat_kit.cli."))
        for m, deps in _graph().items()
        if not (m == "remat_kit.cli" or m.startswith("remat_kit.cli."))
    }
    assert not {m: d for m, d in bad.items() if d}


#: Top-level names of the experiments' code (experiments/ on sys.path): the scripts and the
#: trainer build on the library, never the reverse (issue 52).
EXPERIMENTS = {"experiments", "trainer"} | {
    p.stem for p in (PKG.parent / "experiments").iterdir() if p.suffix == ".py" or p.is_dir()
}


def _top_level_imports(path: pathlib.Path) -> set[str]:
    out = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            out |= {a.name.partition(".")[0] for a in node.names}
        elif isinstance(node, ast.ImportFrom) and not node.level and node.module:
            out.add(node.module.partition(".")[0])
    return out


def test_library_never_imports_the_experiments():
    assert "trainer" in EXPERIMENTS and "gpu_check" in EXPERIMENTS
    bad = {m: sorted(_top_level_imports(p) & EXPERIMENTS) for m, p in _modules().items()}
    assert not {m: d for m, d in bad.items() if d}


@pytest.mark.parametrize("leaf", LEAVES)
def test_leaf_modules_import_nothing_from_remat_kit(leaf):
    assert _graph()[leaf] == set()


#: The core every tool stands on, and what it must not stand on: the bundled models, their
#: trainer and the zoo that makes them Programs (issue 52).
CORE = ("remat_kit.program", "remat_kit.policies", "remat_kit.walker", "remat_kit.targets")
ZOO = ("remat_kit.zoo", "remat_kit.models", "remat_kit.training")


def _reach(graph: dict[str, set[str]], start: str) -> set[str]:
    seen, todo = set(), [start]
    while todo:
        for d in graph.get(todo.pop(), ()):
            if d not in seen:
                seen.add(d)
                todo.append(d)
    return seen


@pytest.mark.parametrize("core", CORE)
def test_the_core_imports_nothing_from_the_zoo(core):
    graph = _graph()
    below = {d for d in _reach(graph, core) if d.startswith(ZOO)}
    assert not below, f"{core} reaches {sorted(below)}"


def test_reach_follows_imports_through_other_modules():
    assert _reach({"a": {"b"}, "b": {"c"}, "c": set()}, "a") == {"b", "c"}


def test_cycle_finder_finds_a_cycle():
    assert _find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert _find_cycle({"a": {"b"}, "b": set()}) is None


def test_public_api_imports():
    import remat_kit

    missing = [n for n in remat_kit.__all__ if not hasattr(remat_kit, n)]
    assert not missing
    assert list(remat_kit.__all__) == sorted(remat_kit.__all__, key=str)


def test_the_code_passes_the_linter():
    """`ruff check` (pyproject's rules) over the library, tests and experiments: lines over
    100 characters and unsorted imports had landed unseen (session 15)."""
    pytest.importorskip("ruff", reason="ruff not installed (the dev extra installs it)")
    dirs = [str(PKG.parent / d) for d in ("remat_kit", "tests", "experiments")]
    cmd = [sys.executable, "-m", "ruff", "check", "--quiet", *dirs]
    done = subprocess.run(cmd, capture_output=True, text=True, cwd=PKG.parent)
    assert done.returncode == 0, done.stdout[-3000:]


def test_importing_the_library_leaves_the_heavy_optional_modules_unloaded():
    """``import remat_kit.cli`` (every CLI call, a usage error included) loaded orbax and
    matplotlib (about 2.5 s on this VM) for commands that never checkpoint or draw."""
    code = (
        "import sys, remat_kit.cli\n"
        "print(sorted({m.split('.')[0] for m in sys.modules} & {'orbax', 'matplotlib'}))"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.strip() == "[]", done.stdout
