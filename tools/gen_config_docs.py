"""Regenerate docs/config.md from the config dataclasses: `python tools/gen_config_docs.py`."""
from pathlib import Path

from paratron.config import reference_markdown

out = Path(__file__).resolve().parent.parent / "docs" / "config.md"
out.write_text(reference_markdown())
print(f"wrote {out}")
