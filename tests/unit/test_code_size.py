"""The library stays small enough to read: no file over 500 lines, no function over 60."""
from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[2] / "paratron"
MAX_FILE_LINES, MAX_FUNCTION_LINES = 500, 60


def sizes():
    for f in sorted(PACKAGE.rglob("*.py")):
        src = f.read_text()
        yield f, src.count("\n"), [(node.name, node.lineno, node.end_lineno - node.lineno + 1)
                                   for node in ast.walk(ast.parse(src))
                                   if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef))]


def test_no_file_over_500_lines_and_no_function_over_60():
    long_files, long_functions = [], []
    for f, lines, functions in sizes():
        rel = f.relative_to(PACKAGE.parent)
        if lines > MAX_FILE_LINES:
            long_files.append(f"{rel} ({lines} lines)")
        long_functions += [f"{rel}:{at} {name} ({n} lines)" for name, at, n in functions if n > MAX_FUNCTION_LINES]
    assert not long_files and not long_functions, "split these: " + "; ".join(long_files + long_functions)
