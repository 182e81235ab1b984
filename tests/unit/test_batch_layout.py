"""BatchLayout on one process: shapes and transfer specs from the config and ParallelDims, position
ids, the micro-batch preparation, the two loss normalisations; and the freeing of a sent activation
with its backward still correct."""
import pytest
import torch

from paratron.parallel.dims import ParallelDims
from paratron.parallel.layout import BatchLayout, microbatch_loss
from paratron.parallel.p2p import TensorSpec
from paratron.parallel.pipeline import _Viewless, backward_freed, deallocate_output_tensor
from tests.parallel.common import tiny_config


def test_from_config_activation_shape_and_specs():
    cfg = tiny_config("gpt", bf16=True)  # seq 32, hidden 64, micro-batch 2
    layout = BatchLayout.from_config(cfg, ParallelDims(), torch.device("cpu"), torch.bfloat16)
    assert layout.activation_shape() == (32, 2, 64)
    assert layout.p2p_specs() == [TensorSpec((32, 2, 64), torch.bfloat16)]
    assert not layout.calculate_per_token_loss and not layout.sequence_parallel


def test_sequence_parallelism_splits_the_boundary_over_tp():
    cfg = tiny_config("gpt", world_size=4, tensor_model_parallel_size=4, sequence_parallel=True,
                      calculate_per_token_loss=True)
    layout = BatchLayout.from_config(cfg, ParallelDims(world_size=4, tp=4), torch.device("cpu"), torch.float32)
    assert layout.activation_shape() == (8, 2, 64) and layout.local_seq_length == 32
    assert layout.calculate_per_token_loss
    no_sp = BatchLayout.from_config(tiny_config("gpt", world_size=4, tensor_model_parallel_size=4), ParallelDims(world_size=4, tp=4),
                                    torch.device("cpu"), torch.float32)
    assert no_sp.activation_shape() == (32, 2, 64)


def test_shape_checks():
    with pytest.raises(ValueError, match="sequence length 30 is not divisible by 4"):
        BatchLayout(2, 30, 8, tp=4, sequence_parallel=True)
    assert BatchLayout(2, 30, 8, tp=4).activation_shape() == (30, 2, 8)
    assert TensorSpec([3, 4], torch.float32).shape == (3, 4)
    assert TensorSpec((3,), torch.float32).has_grad and not TensorSpec((3,), torch.int64).has_grad


def test_context_parallel_slice():
    layout = BatchLayout(2, 32, 8, cp=2)
    assert layout.activation_shape() == (16, 2, 8)
    assert layout.slice_sequence(torch.arange(32).expand(2, 32))[0].tolist() == [*range(8), *range(24, 32)]
    with pytest.raises(ValueError, match="a dense attention mask cannot be split"):
        layout.prepare(dict(batch(2, 32), attention_mask=torch.zeros(2, 1, 32, 32, dtype=torch.bool)))


def batch(b=2, s=6):
    pos = torch.tensor([[0, 1, 2, 0, 1, 2]] * b)  # as --reset-position-ids gives after an EOD at 2
    return {"tokens": torch.arange(b * s).view(b, s), "labels": torch.ones(b, s, dtype=torch.long),
            "loss_mask": torch.ones(b, s), "position_ids": pos}


def test_position_ids():
    plain, reset = BatchLayout(2, 6, 8), BatchLayout(2, 6, 8, reset_position_ids=True)
    assert torch.equal(plain.position_ids(batch()), torch.arange(6).expand(2, 6))  # the data's are ignored
    assert torch.equal(reset.position_ids(batch()), batch()["position_ids"])
    no_pos = {k: v for k, v in batch().items() if k != "position_ids"}
    assert torch.equal(reset.position_ids(no_pos), torch.arange(6).expand(2, 6))  # made when the data has none


def test_prepare_gives_the_model_inputs():
    got = BatchLayout(2, 6, 8).prepare(batch())
    assert set(got) == {"tokens", "labels", "loss_mask", "position_ids", "attention_mask", "document_ids"}
    assert got["attention_mask"] is None and got["document_ids"] is None and torch.equal(got["tokens"], batch()["tokens"])
    assert got["position_ids"] is None  # 0 .. s-1: the model's own (contiguous rotary table)
    reset = BatchLayout(2, 6, 8, reset_position_ids=True).prepare(batch())
    assert torch.equal(reset["position_ids"], batch()["position_ids"])
    mask = torch.zeros(2, 1, 6, 6, dtype=torch.bool)
    assert BatchLayout(2, 6, 8).prepare(dict(batch(), attention_mask=mask))["attention_mask"] is not None


def test_the_two_normalisations():
    loss_sum, n = torch.tensor(12.0), torch.tensor(4.0)
    default = microbatch_loss(loss_sum, n, 3)
    assert torch.equal(default, loss_sum / n.clamp(min=1) / 3)  # the expression the schedules always used
    assert microbatch_loss(loss_sum, torch.tensor(0.0), 2).item() == 6.0  # no tokens: the sum (zero in practice)
    assert microbatch_loss(loss_sum, n, 3, per_token=True) is loss_sum
    assert BatchLayout(1, 4, 8, calculate_per_token_loss=True).microbatch_loss(loss_sum, n, 3) is loss_sum
    assert torch.equal(BatchLayout(1, 4, 8).microbatch_loss(loss_sum, n, 3), default)


@pytest.mark.parametrize("case", ["plain", "view", "saved"])
def test_freed_output_keeps_its_backward(case):
    """After deallocate_output_tensor the output's storage is gone (a view first made viewless, as the
    schedule does), and backward_freed gives the gradients of the intact graph. "saved": the last op
    (tanh) keeps its own result for its backward; that reference keeps the values alive and right."""
    torch.manual_seed(0)
    w = torch.randn(6, 4, requires_grad=True)
    x = torch.randn(10, 6)
    g = torch.randn(5, 2, 4)

    def make():
        h = x @ w
        return {"plain": lambda: h.view(5, 2, 4) * 1.0, "view": lambda: h.view(5, 2, 4),
                "saved": lambda: torch.tanh(h.view(5, 2, 4))}[case]()
    make().backward(g)
    expect, w.grad = w.grad.clone(), None

    y = make()
    assert (y._base is not None) == (case == "view")
    handle = y.untyped_storage()._weak_ref()
    out = _Viewless.apply(y) if case == "view" else y
    del y
    deallocate_output_tensor(out)
    assert out.untyped_storage().nbytes() == 0
    assert torch.UntypedStorage._expired(handle) == (case != "saved")
    torch.UntypedStorage._free_weak_ref(handle)
    with pytest.raises(RuntimeError, match="shape"):  # why the schedule does not call torch.autograd.backward
        torch.autograd.backward(out, g, retain_graph=True)
    backward_freed([out], [g])
    assert torch.equal(w.grad, expect)


def test_deallocate_leaves_views_and_leaves_alone():
    leaf = torch.randn(3, requires_grad=True)
    deallocate_output_tensor(leaf)
    assert leaf.shape == (3,)
    view = (leaf * 2).view(3, 1)
    deallocate_output_tensor(view)
    assert view.shape == (3, 1)
