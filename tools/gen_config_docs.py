"""Regenerate docs/config.md (the config reference) and docs/megatron_flags.md (every Megatron-LM flag
with paratron's status) from the config dataclasses and the Megatron flag table:
`python tools/gen_config_docs.py`."""
from pathlib import Path

from paratron.config.docs import megatron_flags_markdown, reference_markdown

docs = Path(__file__).resolve().parent.parent / "docs"
for name, text in (("config.md", reference_markdown()), ("megatron_flags.md", megatron_flags_markdown())):
    (docs / name).write_text(text)
    print(f"wrote {docs / name}")
