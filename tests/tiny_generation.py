"""A tiny Llama with a trained byte-level BPE tokenizer, saved as a Hugging Face directory and converted to
a paratron checkpoint with its tokenizer (the generation and serving tests use it)."""
from __future__ import annotations

from pathlib import Path

import torch


def make_tiny_checkpoint(d: Path, scale: float = 6.0) -> Path:
    """``d/hf`` and ``d/ckpt``; weights ``scale`` times transformers' init, so greedy choices are not
    near-ties that a different batch (padding) could flip."""
    import transformers

    from paratron.checkpoint.convert import from_hf
    from paratron.checkpoint.tokenizer_files import save_tokenizer
    from paratron.config import DataConfig
    from paratron.data.bpe_train import train_bpe_tokenizer
    (d / "corpus.txt").write_text("the quick brown fox jumps over the lazy dog\nhello world, hello there\n" * 40)
    tok_file = train_bpe_tokenizer([str(d / "corpus.txt")], 300, str(d / "tok" / "tokenizer.json"))
    cfg = transformers.LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                                   num_key_value_heads=2, vocab_size=300, max_position_embeddings=64)
    torch.manual_seed(0)
    hf = transformers.LlamaForCausalLM(cfg)
    with torch.no_grad():
        for p in hf.parameters():
            if p.dim() > 1:
                p.mul_(scale)
    hf.save_pretrained(d / "hf")
    from_hf(d / "hf", d / "ckpt")
    save_tokenizer(d / "ckpt", DataConfig(tokenizer_type="HuggingFaceTokenizer", tokenizer_model=tok_file))
    return d / "ckpt"
