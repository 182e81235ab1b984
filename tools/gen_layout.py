"""Regenerate the layout tree of docs/design.md from the package: every package and module of paratron/ with the
first line of its docstring, between the ``<!-- layout:begin -->`` / ``<!-- layout:end -->`` markers.

    python tools/gen_layout.py           # rewrite docs/design.md (make docs runs it)
    python tools/gen_layout.py --check   # exit 1 when docs/design.md's tree is stale
"""
from __future__ import annotations

import ast
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
DESIGN = ROOT / "docs" / "design.md"
BEGIN, END = "<!-- layout:begin -->", "<!-- layout:end -->"
NAME_WIDTH = 28  # the description column starts here (longer names push it right)


def first_line(path: Path) -> str:
    """The first line of a module's docstring ("" when it has none or does not parse)."""
    try:
        doc = ast.get_docstring(ast.parse(path.read_text(encoding="utf-8")))
    except (SyntaxError, UnicodeDecodeError):
        return ""
    return doc.strip().splitlines()[0].strip() if doc and doc.strip() else ""


def entry(depth: int, name: str, text: str) -> str:
    head = "  " * depth + name
    return (head.ljust(NAME_WIDTH) + " " + text).rstrip() if text else head


def walk(folder: Path, depth: int) -> list[str]:
    """Lines for the contents of one package folder: modules first, then sub-packages and data folders."""
    lines = []
    for p in sorted(folder.glob("*.py")):
        if p.name != "__init__.py":
            lines.append(entry(depth, p.name, first_line(p)))
    for sub in sorted(d for d in folder.iterdir() if d.is_dir() and not d.name.startswith((".", "_"))):
        init = sub / "__init__.py"
        if init.is_file():
            lines.append(entry(depth, sub.name + "/", first_line(init)))
            lines += walk(sub, depth + 1)
        elif any(f.is_file() for f in sub.iterdir()):
            kinds = sorted({f.suffix.lstrip(".") or f.name for f in sub.iterdir() if f.is_file()})
            lines.append(entry(depth, sub.name + "/", "package data (" + ", ".join(kinds) + ")"))
    return lines


def layout_tree(package: Path = ROOT / "paratron") -> str:
    """The tree as a fenced block: ``paratron/`` and everything under it."""
    return "\n".join(["```", entry(0, package.name + "/", first_line(package / "__init__.py")),
                      *walk(package, 1), "```"])


def with_tree(text: str, tree: str) -> str:
    """``text`` with the part between the markers replaced by ``tree``; a ValueError without both markers."""
    start, stop = text.find(BEGIN), text.find(END)
    if start < 0 or stop < start:
        raise ValueError(f"docs/design.md needs the markers {BEGIN} and {END}, in that order")
    return text[:start + len(BEGIN)] + "\n" + tree + "\n" + text[stop:]


def main(argv: list[str]) -> int:
    current = DESIGN.read_text(encoding="utf-8")
    wanted = with_tree(current, layout_tree())
    if "--check" in argv:
        if wanted != current:
            print("docs/design.md's layout tree is stale: run `make docs` (python tools/gen_layout.py)")
            return 1
        return 0
    if wanted != current:
        DESIGN.write_text(wanted, encoding="utf-8")
        print(f"wrote {DESIGN}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
