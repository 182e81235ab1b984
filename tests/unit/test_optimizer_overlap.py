"""The pieces of optim/overlap.py that run without a GPU: how a GPT model's parameters split into the
pieces its forward uses in order (each parameter once, a tied weight in its first piece), and the fused
AdamW's launch batches (any order, every batch reported, the same result as one batch) under Triton's
CPU interpreter. The side stream itself is checked on CUDA in tests/gpu/test_fused_adamw_cuda.py."""
import pytest
import torch

from paratron.config import ModelConfig
from paratron.model.gpt import GPTModel
from paratron.optim.overlap import forward_pieces


def _model(tied: bool) -> GPTModel:
    m = ModelConfig(num_layers=3, hidden_size=32, num_attention_heads=4, seq_length=8, max_position_embeddings=8,
                    untie_embeddings_and_output_weights=not tied)
    return GPTModel(m, 64, seed=1)


@pytest.mark.parametrize("tied", [False, True], ids=["untied", "tied"])
def test_forward_pieces_cover_each_parameter_once_in_forward_order(tied):
    model = _model(tied)
    pieces = forward_pieces(model)
    modules = [m for m, _ in pieces]
    assert modules == [model] + list(model.decoder.layers) + [model.decoder.final_layernorm]
    params = [p for _, ps in pieces for p in ps]
    assert len(params) == len({id(p) for p in params}) == len(list(model.parameters()))
    head, tail = pieces[0][1], pieces[-1][1]
    word = model.embedding.word_embeddings.weight
    assert any(p is word for p in head) and not any(p is word for p in tail)
    assert any(p is model.output_layer.weight for p in tail) != tied  # tied: the output layer has no weight
    for layer, (_, ps) in zip(model.decoder.layers, pieces[1:-1]):
        assert {id(p) for p in ps} == {id(p) for p in layer.parameters()}


BATCHES = r"""
import torch
from paratron.optim.fused_adamw import adamw_step_
torch.manual_seed(0)
init = [torch.randn(s) for s in [(5, 9), (70,), (3,), (4, 4)]]
grads = [torch.randn_like(t) for t in init]


def run(batches_of):
    ps = [t.clone() for t in init]
    adam = torch.optim.AdamW([dict(params=ps[:2], weight_decay=0.1), dict(params=ps[2:], weight_decay=0.0)], lr=1e-2)
    outs = {ps[0]: torch.empty(5, 9, dtype=torch.bfloat16)}
    for p, g in zip(ps, grads):
        p.grad = g.clone()
    seen = []
    batches = None if batches_of is None else [[ps[i] for i in b] for b in batches_of]
    adamw_step_(adam, outs, torch.tensor(1.5), torch.tensor(0.0), batches, None if batches is None else seen.append)
    return ps, outs[ps[0]], seen


ref, ref_out, _ = run(None)
# the launch order of the overlap (forward order across the parameter groups), with an empty batch
for order in ([[3], [1, 0], [], [2]], [[0, 1, 2, 3]]):
    ps, out, seen = run(order)
    assert seen == list(range(len(order))), seen
    assert all(torch.equal(p, q) for p, q in zip(ps, ref)) and torch.equal(out, ref_out)
try:
    run([[0, 1], [2]])
except ValueError as e:
    assert "every master" in str(e)
else:
    raise AssertionError("a master left out of the batches must be an error")
print("ok")
"""


def test_adamw_launch_batches_in_the_interpreter():
    pytest.importorskip("triton")
    from tests.interpret import interpret
    interpret(BATCHES)
