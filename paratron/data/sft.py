"""Supervised fine-tuning data (Megatron's ``--sft``): chat conversations from JSONL, packed into samples.

Each line of a ``.jsonl`` file given as ``--data-path`` (or per split) holds ``{"messages": [...]}``, a
list of ``{"role": "system" | "user" | "assistant" | "tool", "content": text}``. A line may pack several
conversations: each starts at a system message. Each conversation is rendered in the prompt format of
``--sft-tokenizer-prompt-format`` and tokenized; the loss covers the assistant turns only (system, user
and tool turns, and the assistant prefix the format puts at the start of an assistant turn, carry no
loss). The conversations of a line are packed into one sample of ``--seq-length`` tokens: positions
restart at each conversation and attention stays within it (document ids, as ``--reset-attention-mask``
gives pretraining data); what is left is padding, out of the loss. A conversation that overflows the
sample is cut on the right and the rest of the line dropped. Sample i reads line i of the split (in
file order, cycling over the split when more samples are asked for), as Megatron's SFTDataset does;
``--dataloader-type cyclic`` shuffles them.

Prompt formats (Megatron's): ``nemotron-h-aligned`` (the default), ``nemotron-nano-v2``, ``identity``
(the contents concatenated) and ``default`` (the tokenizer's own ``chat_template`` from its
``tokenizer_config.json``, rendered with jinja2; every token in the loss, as Megatron does for it).

Where paratron differs from Megatron, on purpose: a turn-masked conversation is tokenized turn by turn
and the pieces concatenated, so the mask always lines up with the turns (Megatron tokenizes the whole
text and masks by the lengths of the turns tokenized alone, which shifts the mask where a BPE merge
crosses a turn boundary); the padding is masked by position, not by id, so a pad id that is also a real
token (``default`` pads with EOS when the tokenizer has no pad token) keeps its loss where it is text;
the first token of a conversation is never a target (its prediction would come from the conversation
before, which attention does not let it see);
conversations are not padded to a multiple of 2 x CP (paratron's context parallelism takes the document
ids as they are); JSON is read with the json module (Megatron loads it with HF ``datasets``).
"""
from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Callable, Dict, List, Optional, Tuple

import numpy as np
import torch

from ..config.values import SFT_PROMPT_FORMATS
from .chat_template import render_template
from .errors import DataError

ROLES = ("system", "user", "assistant", "tool")
_THINK = re.compile(r"/no_think|/think")


def _h_aligned(role: str, content: str) -> str:
    text = content.strip()
    if role == "system":
        return f"<SPECIAL_10>System\n{text}\n"
    if role == "user":
        return f"<SPECIAL_11>User\n{text}\n<SPECIAL_11>Assistant\n"
    return f"{text}\n" if role == "assistant" else ""


def _nano_v2(role: str, content: str) -> str:
    text = content.strip() if role == "assistant" else _THINK.sub("", content).strip()
    if role == "system":
        return f"<SPECIAL_10>System\n{text}\n"
    if role == "user":
        return f"<SPECIAL_11>User\n{text}\n"
    return f"<SPECIAL_11>Assistant\n{text}\n<SPECIAL_12>\n" if role == "assistant" else ""


@dataclass(frozen=True)
class PromptFormat:
    """One of Megatron's SFT prompt formats: how a turn is written, the padding token, and how many
    tokens of an assistant turn are its prefix (no loss on them)."""

    turn: Optional[Callable[[str, str], str]]  # None: the tokenizer's chat template (whole conversation)
    pad_token: Optional[str]  # None: the tokenizer's pad token, else its EOS
    assistant_prefix_len: int = 0


FORMATS: Dict[str, PromptFormat] = dict(zip(SFT_PROMPT_FORMATS, (  # the names: paratron/config/values.py
    PromptFormat(_h_aligned, "<SPECIAL_233>"),
    PromptFormat(_nano_v2, "<unk>", assistant_prefix_len=3),
    PromptFormat(lambda role, content: content, "<unk>"),
    PromptFormat(None, None))))


class ConversationTokenizer:
    """Conversations -> (token ids, loss flags) in one prompt format, over a paratron tokenizer."""

    def __init__(self, tokenizer, prompt_format: str):
        if prompt_format not in FORMATS:
            raise DataError(f"--sft-tokenizer-prompt-format {prompt_format!r} is not one of {', '.join(FORMATS)}")
        self.tok, self.name, self.format = tokenizer, prompt_format, FORMATS[prompt_format]
        self.template = None
        if self.format.turn is None:
            self.template = getattr(tokenizer, "chat_template", None)
            if not self.template:
                raise DataError("--sft-tokenizer-prompt-format default uses the tokenizer's chat_template, and "
                                "its tokenizer_config.json has none; pick another format")
            import importlib.util
            if importlib.util.find_spec("jinja2") is None:  # what renders the template
                raise DataError("--sft-tokenizer-prompt-format default renders the tokenizer's chat_template with "
                                "jinja2, which is not installed: pip install jinja2")
        self.pad = self._pad_id()

    def _pad_id(self) -> int:
        name = self.format.pad_token
        if name is not None:
            pad = self.tok.token_id(name)
        else:  # the tokenizer's pad token, else its EOS
            pad = self.tok.pad if getattr(self.tok, "pad", None) is not None else self.tok.eod
        if pad is None:
            what = f"the token {name}" if name else "a pad or EOS token"
            raise DataError(f"--sft-tokenizer-prompt-format {self.name} pads with {what}, which the tokenizer "
                            "does not have; use a tokenizer made for this format or pick another format")
        return int(pad)

    def __call__(self, conversation: List[dict]) -> Tuple[List[int], List[bool]]:
        """(ids, loss flags) of one conversation: a flag per id, True where the id is a target."""
        if self.template is not None:
            text = render_template(self.template, conversation, self.tok.special_texts(), False)
            ids = self.tok.ids_of(text)
            return ids, [True] * len(ids)
        ids: List[int] = []
        flags: List[bool] = []
        for turn in conversation:
            piece = self.tok.ids_of(self.format.turn(turn["role"], turn["content"]))
            keep = turn["role"] == "assistant"
            prefix = self.format.assistant_prefix_len if keep else 0
            ids += piece
            flags += [False] * min(prefix, len(piece)) + [keep] * max(len(piece) - prefix, 0)
        return ids, flags


def split_conversations(messages: List[dict]) -> List[List[dict]]:
    """The conversations of one line: a new one starts at each system message (Megatron's rule)."""
    out: List[List[dict]] = []
    for m in messages:
        if m["role"] == "system" or not out:
            out.append([])
        out[-1].append(m)
    return out


def check_messages(messages, where: str) -> List[dict]:
    """A line's messages, checked: roles known, contents text, an assistant turn non-empty and after a
    user or tool turn."""
    if not isinstance(messages, list) or not messages:
        raise DataError(f"{where}: \"messages\" must be a non-empty list of {{\"role\", \"content\"}} objects")
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or m.get("role") not in ROLES or not isinstance(m.get("content"), str):
            raise DataError(f"{where}: message {i} must be {{\"role\": one of {', '.join(ROLES)}, \"content\": text}}")
        if m["role"] == "assistant":
            if not m["content"]:
                raise DataError(f"{where}: message {i} is an empty assistant turn")
            if i == 0 or messages[i - 1]["role"] not in ("user", "tool"):
                raise DataError(f"{where}: message {i} (assistant) must follow a user or tool message")
    return messages


def read_jsonl(path: str) -> List[List[dict]]:
    """Every line's messages of a JSONL file (blank lines skipped), checked."""
    lines = []
    try:
        with open(path, encoding="utf-8") as f:
            for n, line in enumerate(f, 1):
                if not line.strip():
                    continue
                try:
                    record = json.loads(line)
                except ValueError as e:
                    raise DataError(f"{path}:{n}: not JSON ({e})") from None
                if not isinstance(record, dict) or "messages" not in record:
                    raise DataError(f"{path}:{n}: a --sft line must be an object with \"messages\"")
                lines.append(check_messages(record["messages"], f"{path}:{n}"))
    except OSError as e:
        raise DataError(f"--sft data {path}: {e.strerror}") from None
    if not lines:
        raise DataError(f"--sft data {path}: no conversations in it")
    return lines


def pack(conversations: List[Tuple[List[int], List[bool]]], seq_length: int, pad: int) -> Dict[str, torch.Tensor]:
    """One sample of ``seq_length`` tokens from tokenized conversations: tokens, labels, loss_mask,
    position_ids (restarting per conversation) and document_ids (the conversation of each token;
    padding belongs to the last one, which cannot see it: attention is causal)."""
    ids: List[int] = []
    targets: List[bool] = []
    positions: List[int] = []
    docs: List[int] = []
    for k, (piece, flags) in enumerate(conversations):
        ids += piece
        targets += flags
        positions += range(len(piece))
        docs += [k] * len(piece)
        if len(ids) > seq_length:
            break
    n = min(len(ids), seq_length + 1)
    del ids[n:], targets[n:], positions[n:], docs[n:]
    if n == seq_length + 1:
        targets[-1] = False  # a cut conversation: its last kept token has no next token in the sample
    last_pos, last_doc = (positions[-1], docs[-1]) if n else (-1, 0)
    fill = seq_length + 1 - n
    ids += [pad] * fill
    targets += [False] * fill
    positions += range(last_pos + 1, last_pos + 1 + fill)
    docs += [last_doc] * fill
    tokens = torch.tensor(ids, dtype=torch.int64)
    doc = torch.tensor(docs, dtype=torch.int64)
    # a label is a target when its token is, and is not the first of the next conversation
    mask = torch.tensor(targets[1:], dtype=torch.bool) & (doc[1:] == doc[:-1])
    return {
        "tokens": tokens[:-1].clone(),
        "labels": tokens[1:].clone(),
        "loss_mask": mask.to(torch.float32),
        "position_ids": torch.tensor(positions[:-1], dtype=torch.int64),
        "document_ids": doc[:-1].clone(),
    }


class SFTDataset(torch.utils.data.Dataset):
    """``num_samples`` packed samples of the lines ``indices`` of the JSONL file ``path`` (sample i:
    line indices[i mod len(indices)])."""

    def __init__(self, lines: List[List[dict]], path: str, indices: np.ndarray, num_samples: Optional[int],
                 split_name: str, tokenize: ConversationTokenizer, seq_length: int):
        self.lines, self.path_prefix, self.indices = lines, path, indices
        self.tokenize, self.seq_length = tokenize, int(seq_length)
        self.num_samples = len(indices) if num_samples is None else int(num_samples)
        self.description = json.dumps({
            "class": "SFTDataset", "path": path, "split": split_name, "lines": [int(indices[0]), int(indices[-1]) + 1],
            "num_samples": self.num_samples, "seq_length": self.seq_length, "prompt_format": tokenize.name}, indent=4)

    def __len__(self) -> int:
        return self.num_samples

    def __getitem__(self, idx: int) -> Dict[str, torch.Tensor]:
        messages = self.lines[int(self.indices[idx % len(self.indices)])]
        convs = [self.tokenize(c) for c in split_conversations(messages)]
        return pack(convs, self.seq_length, self.tokenize.pad)
