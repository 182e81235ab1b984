"""Layers that only point down (DESIGN.md, principle 10): every paratron import, inside functions too, against
the allowed directions; no import cycle between paratron's top-level packages (a missing package is fine)."""
import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2] / "paratron"
NOT = {"kernels": {"model", "parallel", "train"}, "fp8": {"model", "parallel", "train"}, "parallel": {"model", "train"},
       "model": {"checkpoint", "inference", "train"},
       # the planner is arithmetic over the config, with the kernel switches' resolution and the model's and FP8's
       # own conditions on which path a layer takes: nothing that builds or runs a model (the host's operation
       # count, which runs a tiny one, is train/host_ops.py's, passed in)
       "plan": {"parallel", "train", "optim", "data", "checkpoint", "inference", "core"}}
# config: nothing but itself and errors


def imports():
    """(package, imported package, file:line) for each import of paratron in paratron/."""
    for path in ROOT.rglob("*.py"):
        parts = path.relative_to(ROOT).with_suffix("").parts
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                mods = [a.name.split(".") for a in node.names if a.name.split(".")[0] == "paratron"]
            elif isinstance(node, ast.ImportFrom):
                base = ["paratron", *parts[:len(parts) - node.level]] if node.level else []
                mods = [base + (node.module or a.name).split(".") for a in node.names]
            else:
                continue
            for mod in mods:
                if mod[0] == "paratron" and len(mod) > 1:
                    yield parts[0], mod[1], f"paratron/{path.relative_to(ROOT)}:{node.lineno}"


def test_layers_point_down():
    bad = sorted({f"{at}: {pkg} imports {dep}" for pkg, dep, at in imports() if dep in NOT.get(pkg, ())
                 or (pkg == "config" and dep not in ("config", "errors"))})
    assert not bad, "imports against the layering:\n" + "\n".join(bad)


def test_nothing_imports_the_megatron_core_facade():
    """paratron.core holds the one piece of global state (its compatibility object); the library stays explicit."""
    bad = sorted(f"{at}: {pkg} imports core" for pkg, dep, at in imports() if dep == "core" and pkg != "core")
    assert not bad, "imports of paratron.core from below it:\n" + "\n".join(bad)


def test_no_cycle_between_packages():
    graph = {}
    for pkg, dep, at in imports():
        graph.setdefault(pkg, {}).setdefault(dep, at) if dep != pkg else None

    def cycle(path):
        for dep in graph.get(path[-1], {}):
            found = path[path.index(dep):] + [dep] if dep in path else cycle(path + [dep])
            if found:
                return found
    for start in sorted(graph):
        loop = cycle([start])
        assert not loop, "import cycle: " + ", ".join(f"{a} -> {b} ({graph[a][b]})" for a, b in zip(loop, loop[1:]))
