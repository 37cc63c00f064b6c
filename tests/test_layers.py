"""The packages of plait import one way: each only from the packages below it in its tower."""

from __future__ import annotations

import ast
from pathlib import Path

import plait

# Two towers joined at `schedule` (a schedule is a value the simulator predicts and the runtime
# executes): prediction (cost -> sim -> planner) and execution (runtime -> ops -> nn ->
# parallel, pipelining, coexec); measuring and presenting sit on both. Each package names the
# packages right below it; it may import those and everything below them. The foundation
# (bulk, errors, intervals, tracing) is below everything.
FOUNDATION = ("bulk", "errors", "intervals", "tracing")
BELOW: dict[str, tuple[str, ...]] = {
    "spec": (),
    "workload": ("spec",),
    "schedule": ("workload",),
    # prediction
    "cost": ("workload",),
    "sim": ("cost", "schedule"),
    "planner": ("sim",),
    # execution (co-execution runs the planner's plan values)
    "runtime": ("schedule",),
    # schedule="auto": the planner proposes, the runtime measures, in the user's job
    "tuning": ("runtime", "planner"),
    "ops": ("tuning",),
    "nn": ("ops",),
    "parallel": ("nn",),
    "pipelining": ("parallel", "planner"),  # TensorParallelStage reads the Llama layout
    "coexec": ("nn", "planner"),
    # measuring the user's job, the hardware, and presenting
    "analyze": ("planner",),
    "measure": ("coexec", "parallel", "pipelining"),
    "report": ("analyze", "measure"),
    "cli": ("report",),
    "__main__": ("cli",),
}


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


def _imports(path: Path) -> list[tuple[int, str]]:
    """(line, top-level plait package) of every import in `path`, lazy ones included."""
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module and not node.level:
            names = [node.module]
            if node.module == "plait":  # from plait import ops (not __version__)
                names = [f"plait.{a.name}" for a in node.names if a.name in ALLOWED]
        elif isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        else:
            continue
        found += [(node.lineno, t) for n in names if (t := _top(n))]
    return found


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
        for line, top in _imports(path):
            if top != own and top not in ALLOWED[own]:
                upward.append(f"{rel}:{line} ({own}) imports plait.{top}")
    assert not upward, "imports across or up the towers:\n" + "\n".join(sorted(upward))


def test_the_rule_catches_an_upward_import(tmp_path: Path) -> None:
    bad = tmp_path / "m.py"
    bad.write_text("def f():\n    from plait.report.plots import pyplot\n")
    assert _imports(bad) == [(2, "report")]


PLANNING = [["--help"], ["explore", "--help"], ["presets"], ["explore", "--fast", "--json", "-"],
            ["analyze", "--help"], ["bench", "--help"], ["profile", "--help"],
            ["coexec", "plan", "--help"]]


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
