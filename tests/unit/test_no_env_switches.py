"""Every code path is a config field (the kernel switches record, config/kernels.py), never a PARATRON_*
environment variable: the library's code holds no such name outside docstrings, except the demo's folder
(``PARATRON_DEMO_DIR``, where `paratron demo` writes, which changes no computation)."""
import ast
from pathlib import Path

import paratron

ROOT = Path(paratron.__file__).parent
ALLOWED = {("demo.py", "PARATRON_DEMO_DIR")}


def env_names(source: str) -> set[str]:
    """String constants naming a PARATRON_* variable in ``source``'s code (docstrings left out)."""
    tree = ast.parse(source)
    docstrings = {id(node.body[0].value) for node in ast.walk(tree)
                  if isinstance(node, (ast.Module, ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef))
                  and node.body and isinstance(node.body[0], ast.Expr) and isinstance(node.body[0].value, ast.Constant)}
    return {node.value.split("=")[0] for node in ast.walk(tree)
            if isinstance(node, ast.Constant) and isinstance(node.value, str) and id(node) not in docstrings
            and node.value.startswith("PARATRON_")}


def test_no_paratron_environment_switch_in_the_library():
    found = {(str(path.relative_to(ROOT)), name) for path in ROOT.rglob("*.py")
             for name in env_names(path.read_text())}
    assert not found - ALLOWED, f"PARATRON_* variables in the library (make them kernel switches): {found - ALLOWED}"


def test_the_scan_finds_a_switch_read_from_the_environment():
    code = 'import os\nFAST = os.environ.get("PARATRON_FAST", "1") != "0"\n'
    assert env_names(code) == {"PARATRON_FAST"}
    assert env_names('"""PARATRON_X=1 in a docstring"""\n') == set()
