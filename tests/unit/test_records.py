"""The benchmark records and the pages that cite them (issue 42, item 5): every file in benchmarks/results/ is
cited by README.md, docs/, benchmarks/README.md or a docstring / comment in paratron/, and every
``benchmarks/results/...`` path they cite exists; benchmarks/ holds at most MAX_SCRIPTS scripts; README.md has no
commit hash and no line over 300 characters; docs/performance.md is at most 250 lines."""
from __future__ import annotations

import itertools
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
RESULTS = ROOT / "benchmarks" / "results"
MAX_SCRIPTS = 21
# benchmarks/results/NAME, where NAME may hold one or more {a,b} alternatives (``..._{default,dx}.tsv``)
CITED_PATH = re.compile(r"benchmarks/results/((?:[A-Za-z0-9_.\-]|\{[A-Za-z0-9_.,\-]+\})+)")
# a commit hash: 7-40 hex characters with at least one digit and one letter, a word of its own
COMMIT = re.compile(r"\b(?=[0-9a-f]*[a-f])(?=[0-9a-f]*[0-9])[0-9a-f]{7,40}\b")


def citing_texts(root: Path = ROOT) -> dict[str, str]:
    """The pages whose citations count: README.md, benchmarks/README.md, docs/**.md, paratron/**(.py|.md)."""
    paths = [root / "README.md", root / "benchmarks" / "README.md", *sorted((root / "docs").rglob("*.md"))]
    paths += sorted(p for p in (root / "paratron").rglob("*") if p.suffix in (".py", ".md"))
    return {str(p.relative_to(root)): p.read_text(encoding="utf-8") for p in paths if p.is_file()}


def expand(name: str) -> list[str]:
    """``a_{x,y}.tsv`` -> [``a_x.tsv``, ``a_y.tsv``]; a trailing full stop (end of a sentence) dropped."""
    parts = re.split(r"(\{[^}]*\})", name.rstrip("."))
    options = [p[1:-1].split(",") if p.startswith("{") else [p] for p in parts]
    return ["".join(c).rstrip(".") for c in itertools.product(*options)]


def cited_paths(texts: dict[str, str]) -> dict[str, set[str]]:
    """Every benchmarks/results/ file name a text cites by path -> the texts citing it."""
    out: dict[str, set[str]] = {}
    for where, text in texts.items():
        for m in CITED_PATH.finditer(text):
            for name in expand(m.group(1)):
                out.setdefault(name, set()).add(where)
    return out


def uncited(files: list[str], texts: dict[str, str]) -> list[str]:
    """The record files no text names, by path or by file name (a word of its own, a final full stop aside)."""
    named = set(cited_paths(texts))
    for text in texts.values():
        named.update(w.rstrip(".") for w in re.findall(r"[A-Za-z0-9_.\-]+", text))
    return [f for f in files if f not in named]


def missing(texts: dict[str, str], results: Path = RESULTS) -> list[str]:
    """``where: benchmarks/results/NAME`` for each cited path that does not exist."""
    return sorted(f"{where}: benchmarks/results/{name}" for name, wheres in cited_paths(texts).items()
                  for where in wheres if not (results / name).is_file())


def test_every_record_is_cited():
    files = sorted(p.name for p in RESULTS.iterdir() if p.is_file())
    left = uncited(files, citing_texts())
    assert not left, f"{len(left)} records cited nowhere (git rm them or cite them): {left[:20]}"


def test_every_cited_record_exists():
    gone = missing(citing_texts())
    assert not gone, gone


def test_the_checks_can_fail(tmp_path):
    texts = {"docs/a.md": "see benchmarks/results/x_{1,2}.md and y.log.", "paratron/b.py": "# (z.tsv)"}
    assert uncited(["x_1.md", "x_2.md", "y.log", "z.tsv", "w.md", "y.lo"], texts) == ["w.md", "y.lo"]
    (tmp_path / "x_1.md").write_text("")
    assert missing(texts, tmp_path) == ["docs/a.md: benchmarks/results/x_2.md"]
    assert COMMIT.search("at 75d04f8 on") and COMMIT.search("a1b2c3d4e5f60718293a4b5c6d7e8f9012345678")
    assert not COMMIT.search("2026-12-02, 20261202, decade, fp8_mlp, 1,047 tokens/s")


def test_benchmark_scripts_capped():
    scripts = sorted(p.name for p in (ROOT / "benchmarks").iterdir() if p.suffix in (".py", ".sh"))
    assert len(scripts) <= MAX_SCRIPTS, f"{len(scripts)} scripts in benchmarks/ (at most {MAX_SCRIPTS}): {scripts}"


def test_cited_benchmark_scripts_exist():
    texts = citing_texts()
    cited = {(where, m) for where, t in texts.items() for m in re.findall(r"benchmarks/(\w+\.(?:py|sh))\b", t)}
    gone = sorted(f"{where}: benchmarks/{name}" for where, name in cited if not (ROOT / "benchmarks" / name).is_file())
    assert not gone, gone


def test_readme_has_no_commit_hash_and_short_lines():
    text = (ROOT / "README.md").read_text(encoding="utf-8")
    hashes = [m.group(0) for m in COMMIT.finditer(text)]
    assert not hashes, f"commit hashes in README.md: {hashes}"
    long = [i for i, line in enumerate(text.splitlines(), 1) if len(line) > 300]
    assert not long, f"README.md lines over 300 characters: {long}"


def test_performance_page_is_short_and_has_no_commit_hash():
    text = (ROOT / "docs" / "performance.md").read_text(encoding="utf-8")
    assert len(text.splitlines()) <= 250, f"docs/performance.md has {len(text.splitlines())} lines (at most 250)"
    assert not COMMIT.search(text), COMMIT.search(text).group(0)
