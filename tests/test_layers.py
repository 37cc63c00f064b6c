"""The packages of plait import one way: each only from the packages below it in its tower,
and the execution side never loads the prediction side (checked module by module)."""

from __future__ import annotations

import ast
from pathlib import Path

import plait

# Two towers standing on one waist, `schedule` (the values both share: a schedule and its
# lowering, the co-execution plan, the verdict vocabulary): prediction (cost -> sim -> planner)
# and execution (runtime -> tuning -> ops -> nn -> parallel -> pipelining); measuring and
# presenting sit on both. Each package names the packages right below it; it may import those
# and everything below them. The foundation (bulk, errors, intervals, tracing) is below
# everything.
FOUNDATION = ("bulk", "errors", "intervals", "tracing")
BELOW: dict[str, tuple[str, ...]] = {
    "spec": (),
    "workload": ("spec",),
    "schedule": ("workload",),
    # prediction
    "cost": ("workload",),
    "sim": ("cost", "schedule"),
    "planner": ("sim",),
    # execution
    "runtime": ("schedule",),
    "tuning": ("runtime",),
    "ops": ("tuning",),
    "nn": ("ops",),
    "parallel": ("nn",),
    "pipelining": ("parallel",),
    # measuring the user's job, the hardware, and presenting
    "analyze": ("planner",),
    "measure": ("pipelining", "planner"),
    "report": ("analyze", "measure"),
    "cli": ("report",),
    "__main__": ("cli",),
}
# The one crossing from execution to prediction: schedule="auto" imports the proposer inside
# the call that first needs it (never at module level: see test_execution_never_loads_...).
LAZY = {"tuning": ("planner",)}
EXECUTION = ("runtime", "tuning", "ops", "nn", "parallel", "pipelining")
PREDICTION = ("cost", "sim", "planner")


def _reachable(name: str) -> set[str]:
    out = set(FOUNDATION)
    for below in BELOW.get(name, ()):
        out |= {below} | _reachable(below)
    return out


ALLOWED = {name: _reachable(name) for name in BELOW} | {name: set() for name in FOUNDATION}
ROOT = Path(plait.__file__).parent


def _top(module: str) -> str | None:
    parts = module.split(".")
    return parts[1] if parts[0] == "plait" and len(parts) > 1 else None


def _module(name: str) -> str:
    """`name` if it is a plait module (a file or a package), else the module it is in."""
    rel = Path(*name.split(".")[1:])
    if (ROOT / rel).with_suffix(".py").exists() or (ROOT / rel / "__init__.py").exists():
        return name
    return name.rsplit(".", 1)[0]


def _imports(path: Path) -> list[tuple[int, str, bool]]:
    """(line, plait module, at module level) of every import in `path`, lazy ones (inside a
    function, or for type checking only) included."""
    found: list[tuple[int, str, bool]] = []

    def visit(node: ast.AST, eager: bool) -> None:
        if isinstance(node, ast.ImportFrom) and node.module and not node.level:
            names = [f"{node.module}.{a.name}" for a in node.names]
            found.extend((node.lineno, _module(n), eager) for n in names if _top(n))
        elif isinstance(node, ast.Import):
            found.extend((node.lineno, _module(a.name), eager) for a in node.names
                         if _top(a.name))
        lazy = isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)) or (
            isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test))
        for child in ast.iter_child_nodes(node):
            visit(child, eager and not lazy)

    visit(ast.parse(path.read_text()), True)
    return found


def _name(path: Path) -> str:
    rel = path.relative_to(ROOT).with_suffix("")
    parts = rel.parts[:-1] if rel.name == "__init__" else rel.parts
    return ".".join(("plait", *parts))


def test_every_package_has_a_layer() -> None:
    tops = {p.stem if p.is_file() else p.name for p in ROOT.iterdir()
            if (p.suffix == ".py" or (p / "__init__.py").exists()) and p.stem != "__init__"}
    assert tops <= set(ALLOWED), f"give these a place in BELOW: {sorted(tops - set(ALLOWED))}"


def test_imports_point_down() -> None:
    upward = []
    for path in ROOT.rglob("*.py"):
        rel = path.relative_to(ROOT)
        own = rel.parts[0].removesuffix(".py")
        if own == "__init__":
            continue
        lazy_ok = {t for below in LAZY.get(own, ()) for t in {below} | ALLOWED[below]}
        for line, module, eager in _imports(path):
            top = _top(module)
            if top in (own, None) or top in ALLOWED[own] or (top in lazy_ok and not eager):
                continue
            upward.append(f"{rel}:{line} ({own}) imports {module}"
                          + (" at module level" if top in lazy_ok else ""))
    assert not upward, "imports across or up the towers:\n" + "\n".join(sorted(upward))


def _loaded_by(graph: dict[str, set[str]], start: str) -> set[str]:
    """The modules importing `start` loads: its module-level imports, theirs, and the packages
    each sits in."""
    seen, todo = set(), [start]
    while todo:
        m = todo.pop()
        parents = {".".join(m.split(".")[:i]) for i in range(1, m.count(".") + 1)}
        for n in {m} | parents:
            if n not in seen:
                seen.add(n)
                todo.extend(graph.get(n, ()))
    return seen


def test_execution_never_loads_the_prediction_side() -> None:
    """Module by module: nothing the execution side imports at module level (followed through
    every module it reaches) belongs to `cost`, `sim` or `planner`."""
    graph = {_name(p): {m for _, m, eager in _imports(p) if eager} for p in ROOT.rglob("*.py")}
    bad = []
    for name in sorted(graph):
        if _top(name) in EXECUTION:
            reached = sorted(m for m in _loaded_by(graph, name) if _top(m) in PREDICTION)
            if reached:
                bad.append(f"{name} loads {', '.join(reached)}")
    assert not bad, "\n".join(bad)


def test_the_rules_catch_an_upward_and_an_eager_import(tmp_path: Path) -> None:
    bad = tmp_path / "m.py"
    bad.write_text("import plait.sim.engine\n"
                   "def f():\n    from plait.report.plots import pyplot\n"
                   "if TYPE_CHECKING:\n    from plait.planner import propose\n")
    assert _imports(bad) == [(1, "plait.sim.engine", True), (3, "plait.report.plots", False),
                             (5, "plait.planner.propose", False)]
    graph = {"plait.ops.dense": {"plait.tuning.tuner"}, "plait.tuning.tuner": {"plait.sim.x"}}
    assert "plait.sim.x" in _loaded_by(graph, "plait.ops.dense")
    assert "plait.tuning" in _loaded_by(graph, "plait.ops.dense")


PLANNING = [["--help"], ["explore", "--help"], ["presets"], ["explore", "--fast", "--json", "-"],
            ["analyze", "--help"], ["bench", "--help"], ["profile", "--help"],
            ["coexec", "plan", "--help"],
            ["plan", "--gpus", "8", "--global-batch", "8", "--top", "2", "--json", "-"]]


def test_planning_commands_do_not_import_torch() -> None:
    """Commands that only read or plan start without torch (seconds of start-up saved)."""
    import subprocess
    import sys

    probe = ("import sys, runpy; sys.argv = ['plait', *sys.argv[1:]]\n"
             "try:\n    runpy.run_module('plait', run_name='__main__')\n"
             "except SystemExit:\n    pass\n"
             "sys.stdout = sys.__stdout__\n"
             "print('TORCH' if 'torch' in sys.modules else 'NO-TORCH')")
    for argv in PLANNING:
        out = subprocess.run([sys.executable, "-c", probe, *argv], capture_output=True,
                             text=True, check=True).stdout
        assert out.rstrip().endswith("NO-TORCH"), f"plait {' '.join(argv)} imports torch"


def test_running_a_matmul_loads_no_simulator():
    """Execution stands on the schedule value, not on the prediction side: `import plait.ops`
    (and the layers above it) loads nothing of `cost`, `sim` or `planner`; `schedule="auto"`
    imports the proposer at its first call."""
    import subprocess
    import sys

    code = ("import sys, plait.ops, plait.nn, plait.parallel\n"
            "print(sorted(m for m in sys.modules if m.split('.')[:2] in "
            "(['plait', 'cost'], ['plait', 'sim'], ['plait', 'planner'])))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=120, check=True).stdout
    assert out.strip() == "[]", out
