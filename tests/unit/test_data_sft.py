"""Supervised fine-tuning data (--sft, paratron/data/sft.py): the prompt formats and their loss masks on a
character-level tokenizer whose results can be checked by hand, the packing of a line's conversations, the
errors of bad lines and flags, and the whole path (a HuggingFace tokenizer.json, JSONL files, the dataset
builder, the trainer) on tiny data."""
import json
import os
import sys

import pytest
import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(__file__)))
from data_helpers import build_datasets, data_args, train_tiny_bpe  # noqa: E402

from paratron.train.resolve import parse_args  # noqa: E402
from paratron.errors import ConfigError  # noqa: E402
from paratron.data.errors import DataError  # noqa: E402
from paratron.data.sft import ConversationTokenizer, pack, read_jsonl, split_conversations  # noqa: E402

SPECIAL = {"<SPECIAL_233>": 1, "<unk>": 2}
CONV = [{"role": "system", "content": "S"}, {"role": "user", "content": " hi "}, {"role": "assistant", "content": "yo"}]


class CharTokenizer:
    """One id per character (its code point + 100); the pad tokens above."""
    eod, pad = 3, None

    def token_id(self, token):
        return SPECIAL.get(token)

    def ids_of(self, text):
        return [ord(c) + 100 for c in text]


def chars(text):
    return [ord(c) + 100 for c in text]


def test_nemotron_h_aligned_masks_all_but_the_assistant_turn():
    ids, flags = ConversationTokenizer(CharTokenizer(), "nemotron-h-aligned")(CONV)
    prompt = "<SPECIAL_10>System\nS\n" + "<SPECIAL_11>User\nhi\n<SPECIAL_11>Assistant\n"
    assert ids == chars(prompt + "yo\n")
    assert flags == [False] * len(prompt) + [True] * 3  # "yo\n": the answer and its end
    assert ConversationTokenizer(CharTokenizer(), "nemotron-h-aligned").pad == 1


def test_nano_v2_drops_think_switches_and_masks_the_assistant_prefix():
    conv = [{"role": "system", "content": "be brief /no_think"}, {"role": "user", "content": "q /think"},
            {"role": "assistant", "content": "a"}]
    ids, flags = ConversationTokenizer(CharTokenizer(), "nemotron-nano-v2")(conv)
    prompt = "<SPECIAL_10>System\nbe brief\n<SPECIAL_11>User\nq\n"
    answer = "<SPECIAL_11>Assistant\na\n<SPECIAL_12>\n"
    assert ids == chars(prompt + answer)
    assert flags == [False] * (len(prompt) + 3) + [True] * (len(answer) - 3)  # three prefix tokens: no loss


def test_identity_and_unknown_format():
    ids, flags = ConversationTokenizer(CharTokenizer(), "identity")(CONV)
    assert ids == chars("S hi yo") and flags == [False] * 5 + [True] * 2  # "S", " hi ", then "yo"
    with pytest.raises(DataError, match="'chatml' is not one of nemotron-h-aligned"):
        ConversationTokenizer(CharTokenizer(), "chatml")


def test_a_format_whose_pad_token_is_missing_is_refused():
    SPECIAL.pop("<unk>")
    try:
        with pytest.raises(DataError, match="pads with the token <unk>, which the tokenizer does not have"):
            ConversationTokenizer(CharTokenizer(), "identity")
    finally:
        SPECIAL["<unk>"] = 2


def test_pack_restarts_positions_and_masks_padding_and_boundaries():
    a = ([10, 11, 12], [False, True, True])
    b = ([20, 21], [True, True])
    s = pack([a, b], 8, pad=1)
    assert s["tokens"].tolist() == [10, 11, 12, 20, 21, 1, 1, 1]
    assert s["labels"].tolist() == [11, 12, 20, 21, 1, 1, 1, 1]
    assert s["position_ids"].tolist() == [0, 1, 2, 0, 1, 2, 3, 4]
    assert s["document_ids"].tolist() == [0, 0, 0, 1, 1, 1, 1, 1]
    # targets 11, 12 (conversation a), not 20 (b's first token, from a's last), 21; no padding
    assert s["loss_mask"].tolist() == [1, 1, 0, 1, 0, 0, 0, 0]


def test_pack_cuts_an_overflowing_conversation_and_drops_the_rest():
    a = ([10, 11, 12, 13, 14, 15], [True] * 6)
    s = pack([a, ([20], [True])], 4, pad=1)
    assert s["tokens"].tolist() == [10, 11, 12, 13] and s["labels"].tolist() == [11, 12, 13, 14]
    assert s["loss_mask"].tolist() == [1, 1, 1, 0]  # 14 is cut off with its successor: no target
    assert s["document_ids"].tolist() == [0, 0, 0, 0]


def test_lines_split_at_system_messages():
    two = CONV + [{"role": "system", "content": "T"}, {"role": "user", "content": "u"},
                  {"role": "assistant", "content": "v"}]
    assert [len(c) for c in split_conversations(two)] == [3, 3]
    assert [len(c) for c in split_conversations(CONV[1:])] == [2]  # no system message: one conversation


@pytest.mark.parametrize("line,needle", [
    ("{not json", r"bad.jsonl:2: not JSON"),
    ('{"text": "x"}', r"bad.jsonl:2: a --sft line must be an object with \"messages\""),
    ('{"messages": [{"role": "assistant", "content": "x"}]}', "message 0 \\(assistant\\) must follow a user"),
    ('{"messages": [{"role": "user", "content": "x"}, {"role": "assistant", "content": ""}]}',
     "message 1 is an empty assistant turn"),
    ('{"messages": [{"role": "bot", "content": "x"}]}', "message 0 must be"),
])
def test_bad_lines_name_file_line_and_problem(tmp_path, line, needle):
    path = tmp_path / "bad.jsonl"
    path.write_text(json.dumps({"messages": CONV}) + "\n" + line + "\n")
    with pytest.raises(DataError, match=needle):
        read_jsonl(str(path))


def hf_tokenizer(tmp_path, template=None):
    from tokenizers import Tokenizer as RustTokenizer

    from paratron.data.tokenizers import HuggingFaceTokenizer
    path = train_tiny_bpe(str(tmp_path))
    rust = RustTokenizer.from_file(path)
    rust.add_special_tokens(["<SPECIAL_10>", "<SPECIAL_11>", "<SPECIAL_233>", "<|endoftext|>"])
    rust.save(path)
    config = {"eos_token": "<|endoftext|>"}
    if template:
        config["chat_template"] = template
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(config))
    return HuggingFaceTokenizer(path), path


def conversations(n):
    return [{"messages": [{"role": "system", "content": f"rule {i}"}, {"role": "user", "content": f"the question {i}"},
                          {"role": "assistant", "content": f"answer number {i}"}]
             + ([{"role": "system", "content": "again"}, {"role": "user", "content": "why"},
                 {"role": "assistant", "content": "because"}] if i % 2 else [])} for i in range(n)]


def write_lines(path, records):
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return str(path)


def test_sft_datasets_end_to_end(tmp_path):
    """The builder splits the JSONL by line; the loss covers exactly the assistant answers."""
    tok, _ = hf_tokenizer(tmp_path)
    data = write_lines(tmp_path / "chat.jsonl", conversations(20))
    cfg = data_args(data_path=[data], sft=True, seq_length=160, split="90,10,0",
                    tokenizer_type="HuggingFaceTokenizer")
    train, valid, test = build_datasets(cfg, tok)
    assert test is None and len(train) == cfg.train.train_iters * 8
    for i in (0, 1, 18):  # line 18 is the 19th: the train split holds lines 0-17 and cycles
        s = train[i]
        line = i % 18
        assert s["tokens"].shape == (160,) and s["loss_mask"][-1] == 0  # padded at the end
        answered = tok.text_of(s["labels"][s["loss_mask"] > 0].tolist())
        want = f"answer number {line}\n" + ("because\n" if line % 2 else "")
        assert answered == want, (answered, want)
        assert int(s["document_ids"].max()) == line % 2
    v = valid[0]
    assert tok.text_of(v["labels"][v["loss_mask"] > 0].tolist()) == "answer number 18\n"


def test_default_format_uses_the_chat_template_and_every_token(tmp_path):
    template = "{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}{{ eos_token }}{% endfor %}"
    tok, _ = hf_tokenizer(tmp_path, template)
    ids, flags = ConversationTokenizer(tok, "default")(CONV)
    assert tok.detokenize(ids) == "<system>S<|endoftext|><user> hi <|endoftext|><assistant>yo<|endoftext|>"
    assert all(flags)
    (tmp_path / "bare").mkdir()
    bare, _ = hf_tokenizer(tmp_path / "bare")
    with pytest.raises(DataError, match="default uses the tokenizer's chat_template"):
        ConversationTokenizer(bare, "default")


@pytest.mark.parametrize("flags,needle", [
    (["--sft-tokenizer-prompt-format", "identity"], "--sft-tokenizer-prompt-format: no effect without --sft"),
    (["--sft", "--sft-tokenizer-prompt-format", "chatml"], "must be one of nemotron-h-aligned"),
    (["--sft"], "give --tokenizer-type HuggingFaceTokenizer"),
])
def test_sft_flag_errors(flags, needle):
    with pytest.raises(ConfigError, match=needle):
        parse_args(["--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4", "--seq-length", "64",
                    "--max-position-embeddings", "64", "--micro-batch-size", "2", "--global-batch-size", "4",
                    "--tokenizer-type", "NullTokenizer", "--vocab-size", "256", "--train-iters", "2", *flags])


def test_trainer_takes_sft_batches_with_their_positions(tmp_path):
    """--sft through the Trainer: the batch keeps its per-conversation positions and document ids on the
    way to the model (the layout uses the data's positions), and the loss falls on the answers."""
    from paratron.train.loop import Trainer
    _, path = hf_tokenizer(tmp_path)
    data = write_lines(tmp_path / "chat.jsonl", conversations(16))
    cfg = parse_args(["--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4", "--seq-length", "64",
                      "--max-position-embeddings", "64", "--micro-batch-size", "2", "--global-batch-size", "4",
                      "--train-iters", "12", "--lr", "3e-3", "--num-workers", "0", "--eval-iters", "0",
                      "--tokenizer-type", "HuggingFaceTokenizer", "--tokenizer-model", path, "--sft",
                      "--data-path", data, "--split", "100,0,0", "--seed", "3"])
    t = Trainer(cfg)
    batch = next(t.train_iter)
    ready = t.layout.prepare(batch)
    assert ready["position_ids"] is not None and torch.equal(ready["position_ids"], batch["position_ids"])
    assert ready["document_ids"] is not None and int(batch["document_ids"].max()) == 1
    losses = [(r[0] / r[1]).item() for r in (t.train_step()[0] for _ in range(11))]  # one micro-batch was read above
    assert all(torch.isfinite(torch.tensor(losses))) and losses[-1] < losses[0], losses
