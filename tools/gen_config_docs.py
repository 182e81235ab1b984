"""Regenerate docs/config.md (the config reference), docs/megatron_flags.md (every Megatron-LM flag
with paratron's status) and the kernel-switch table of docs/performance.md from the config dataclasses and
the Megatron flag table: `python tools/gen_config_docs.py`."""
from pathlib import Path

from paratron.config.docs import megatron_flags_markdown, reference_markdown
from paratron.config.help import field_help
from paratron.kernels.switches import choices_markdown, write_switches_table

docs = Path(__file__).resolve().parent.parent / "docs"
for name, text in (("config.md", reference_markdown()), ("megatron_flags.md", megatron_flags_markdown())):
    (docs / name).write_text(text)
    print(f"wrote {docs / name}")
perf = docs / "performance.md"
perf.write_text(write_switches_table(perf.read_text(), choices_markdown(field_help)))
print(f"wrote {perf}")
