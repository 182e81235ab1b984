"""A small rule-based sentence splitter for ``paratron preprocess --split-sentences`` (BERT's data: one
sequence per sentence). Megatron splits with NLTK's punkt model, which paratron does not ship; this splitter
follows punkt's main rules, so most sentences come out the same, not all:

* a sentence ends at ``.``, ``!`` or ``?`` (a run of them, then any closing quotes or brackets) followed by
  whitespace and a token that starts a sentence (an upper-case letter, a digit, an opening quote or bracket);
* a period does not end a sentence after a known abbreviation (``Mr.``, ``Dr.``, ``e.g.``, ``etc.``, ...),
  after a single letter (an initial: ``J. R. R. Tolkien``), or inside a number (``3.14``);
* the whitespace between sentences is dropped, except newlines right after a sentence with ``keep_newlines``
  (Megatron's ``--keep-newlines``), which stay at its end.
"""
from __future__ import annotations

import re
from typing import List

ABBREVIATIONS = frozenset("""mr mrs ms dr prof sr jr st mt vs etc e.g i.e cf al fig figs no nos vol vols p pp ed eds
inc ltd co corp dept est approx jan feb mar apr jun jul aug sep sept oct nov dec gen col lt sgt rev hon gov
u.s u.k a.m p.m""".split())
_END = re.compile(r"[.!?]+[\"')\]»”’]*")
_STARTS = re.compile(r"[\"'(\[«“‘]*[A-Z0-9À-ÖØ-Þ]")


def _word_before(text: str, end: int) -> str:
    """The word that ends at ``end`` (the position of the terminal punctuation), lower-cased."""
    start = end
    while start > 0 and not text[start - 1].isspace():
        start -= 1
    return text[start:end].lower().strip("\"'([«“‘")


def _is_boundary(text: str, match: re.Match) -> bool:
    after = match.end()
    if after >= len(text) or not text[after].isspace():
        return False
    rest = text[after:].lstrip()
    if not rest or not _STARTS.match(rest):
        return False
    if match.group().startswith(".") and match.group().rstrip("\"')]»”’") == ".":
        word = _word_before(text, match.start())
        if word in ABBREVIATIONS or (len(word) == 1 and word.isalpha()):
            return False
    return True


def split_sentences(text: str, keep_newlines: bool = False) -> List[str]:
    """The sentences of ``text`` (non-empty, in order)."""
    out, start = [], 0
    for match in _END.finditer(text):
        if not _is_boundary(text, match):
            continue
        gap_end = match.end()
        while gap_end < len(text) and text[gap_end].isspace():
            gap_end += 1
        end = match.end()
        if keep_newlines:
            gap = text[end:gap_end]
            end += len(gap) - len(gap.lstrip("\n"))  # the newlines right after the sentence stay with it
        out.append(text[start:end].strip(" \t") if keep_newlines else text[start:end].strip())
        start = gap_end
    tail = text[start:].strip(" \t") if keep_newlines else text[start:].strip()
    if tail.strip():
        out.append(tail)
    return [s for s in out if s.strip()]
