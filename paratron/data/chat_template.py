"""A tokenizer's jinja2 chat template applied to a conversation, as transformers renders it: what SFT
data (paratron/data/sft.py) and chat prompts (paratron/inference/text.py) both use. jinja2 comes with
the serve / test extras: it is imported when a template is rendered."""
from __future__ import annotations

from datetime import datetime


def _template_error(message: str):
    """What chat templates call to refuse a conversation (as transformers provides it)."""
    raise ValueError(message)


def render_template(template: str, messages: list[dict], special: dict, add_generation_prompt: bool) -> str:
    """A tokenizer's jinja2 chat template applied to ``messages``, as transformers renders it (a sandbox,
    trimmed blocks, its ``raise_exception`` and ``strftime_now``; ``special``: bos_token, eos_token, ...)."""
    from jinja2.sandbox import ImmutableSandboxedEnvironment
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
    env.globals.update(raise_exception=_template_error, strftime_now=lambda f: datetime.now().strftime(f))
    return env.from_string(template).render(messages=messages, add_generation_prompt=add_generation_prompt, **special)
