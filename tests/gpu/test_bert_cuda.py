"""BERT on CUDA: bf16 logits of a padded batch (SDPA under the key padding mask; FlashAttention-4 hands masked
passes to SDPA) against the float64 CPU model with the same weights, and a few bf16 training-step gradients
finite; skipped without a GPU."""
from __future__ import annotations

import pytest
import torch

from paratron.config import ModelConfig
from paratron.model.bert import BertModel

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


def _cfg():
    return ModelConfig(model="bert", num_layers=2, hidden_size=256, num_attention_heads=4, seq_length=128,
                       hidden_dropout=0.0, attention_dropout=0.0).resolved()


def test_bert_bf16_cuda_equals_cpu_float64():
    cfg = _cfg()
    ref = BertModel(cfg, 1024, dtype=torch.float64).eval()
    gpu = BertModel(cfg, 1024, device="cuda", dtype=torch.bfloat16).eval()
    gpu.load_state_dict({k: v.to(torch.bfloat16) for k, v in ref.state_dict().items()})
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(5, 1024, (4, 128), generator=g)
    types = (torch.arange(128) >= 64).long().expand(4, 128)
    pad = torch.arange(128).expand(4, 128) < torch.tensor([[128], [100], [77], [30]])
    with torch.no_grad():
        want, want_bin = ref(ids, padding_mask=pad, tokentype_ids=types)
        got, got_bin = gpu(ids.cuda(), padding_mask=pad.cuda(), tokentype_ids=types.cuda())
    real = pad[..., None].expand_as(want)
    err = (got.double().cpu() - want)[real].abs().max() / want[real].abs().max()
    assert err < 3e-2, err
    assert (got_bin.double().cpu() - want_bin).abs().max() < 5e-2


def test_bert_bf16_training_step_gradients_finite():
    cfg = _cfg()
    model = BertModel(cfg, 1024, device="cuda", dtype=torch.bfloat16).train()
    ids = torch.randint(5, 1024, (4, 128), device="cuda")
    labels = torch.where(torch.rand(4, 128, device="cuda") < 0.15, ids, torch.full_like(ids, -1))
    loss, binary = model(ids, padding_mask=torch.ones_like(ids, dtype=torch.bool),
                         tokentype_ids=torch.zeros_like(ids), lm_labels=labels)
    total = (loss.float() * (labels >= 0)).sum() / (labels >= 0).sum() + binary.float().logsumexp(-1).mean()
    total.backward()
    assert all(p.grad is not None and torch.isfinite(p.grad).all() for p in model.parameters() if p.requires_grad)
