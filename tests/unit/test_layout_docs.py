"""docs/design.md's layout tree is generated from the package (tools/gen_layout.py, run by `make docs`): this
fails when a module is added, moved, removed or its docstring's first line changed without regenerating it."""
from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
spec = importlib.util.spec_from_file_location("gen_layout", ROOT / "tools" / "gen_layout.py")
gen_layout = importlib.util.module_from_spec(spec)
spec.loader.exec_module(gen_layout)


def test_design_layout_tree_is_current():
    current = gen_layout.DESIGN.read_text(encoding="utf-8")
    assert gen_layout.with_tree(current, gen_layout.layout_tree()) == current, \
        "docs/design.md's layout tree is stale: run `make docs` (python tools/gen_layout.py)"


def test_the_tree_follows_the_package(tmp_path):
    pkg = tmp_path / "pkg"
    (pkg / "sub").mkdir(parents=True)
    (pkg / "data").mkdir()
    (pkg / "__init__.py").write_text('"""The package."""\n')
    (pkg / "a.py").write_text('"""Module a.\n\nMore."""\nx = 1\n')
    (pkg / "sub" / "__init__.py").write_text("")
    (pkg / "sub" / "b.py").write_text("x = 1\n")
    (pkg / "data" / "t.yaml").write_text("a: 1\n")
    tree = gen_layout.layout_tree(pkg)
    assert [line.split() for line in tree.splitlines()] == [
        ["```"], ["pkg/", "The", "package."], ["a.py", "Module", "a."], ["data/", "package", "data", "(yaml)"],
        ["sub/"], ["b.py"], ["```"]]
    doc = "intro\n<!-- layout:begin -->\nold tree\n<!-- layout:end -->\nafter\n"
    new = gen_layout.with_tree(doc, tree)
    assert new != doc and "old tree" not in new and new.endswith("<!-- layout:end -->\nafter\n")
    assert gen_layout.with_tree(new, tree) == new  # regenerating a current page changes nothing
    (pkg / "c.py").write_text('"""Module c."""\n')  # a new module makes the page stale
    assert gen_layout.with_tree(new, gen_layout.layout_tree(pkg)) != new
    with pytest.raises(ValueError):
        gen_layout.with_tree("no markers", tree)
