"""--fine-grained-activation-offloading --offload-modules ... (paratron/model/activation_offload.py) on CPU:
training equals training without it bit for bit (every point, dense and MoE layers, with and without the fused
residual), what autograd keeps besides the host copies shrinks, the fraction and the size filter pick what they
say, backward prefetches the group saved before the one it reloads, and the refusals. (Pipeline parallelism:
tests/parallel/test_pipeline.py's pp2_virtual2_offload; CUDA: tests/gpu/test_activation_offload_cuda.py.)"""
from __future__ import annotations

import pytest
import torch

from paratron.config import ConfigError, parse_args
from paratron.model import activation_offload as offload
from paratron.model.recompute import saved_storage_bytes
from paratron.train.loop import Trainer
from tests.unit.test_train import TINY, losses_of

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")

ALL = ["attn_norm", "qkv_linear", "core_attn", "attn_proj", "mlp_norm", "expert_fc1", "moe_act"]
LLAMA_MOE = ["--swiglu", "--normalization", "RMSNorm", "--position-embedding-type", "rope", "--num-experts", "4",
             "--moe-grouped-gemm", "--bf16"]
NO_DROPOUT = ["--hidden-dropout", "0", "--attention-dropout", "0"]  # (dropout off: the fused residual path)


def _flags(*extra: str, modules=ALL, size: int = 0) -> list:
    return TINY + ["--train-iters", "6", "--eval-iters", "0", *extra, "--fine-grained-activation-offloading",
                   "--offload-modules", *modules, "--min-offloaded-tensor-size", str(size)]


def _run(flags: list, steps: int = 3):
    t = Trainer(parse_args(flags))
    losses = losses_of(t, steps)
    return t, losses, [p.detach().clone() for m in t.models for p in m.parameters()]


@pytest.mark.parametrize("extra", [LLAMA_MOE + NO_DROPOUT, ["--attention-dropout", "0.1"]], ids=["moe", "gpt"])
def test_training_equals_training_without_offloading(extra):
    _, want, ref = _run(TINY + ["--train-iters", "6", "--eval-iters", "0", *extra])
    t, got, params = _run(_flags(*extra))
    assert got == want
    assert all(torch.equal(a, b) for a, b in zip(params, ref))
    off = t.models[0].module.decoder.offloader
    assert off.offloaded_bytes > 0
    points = {name for layer in t.models[0].module.decoder.layers for m, name in offload.points_of(layer)
              if name in m.__dict__.get("offload_points", {})}
    assert points == (set(ALL) if "--num-experts" in extra else set(ALL) - {"expert_fc1", "moe_act"})


def _layer_saved_bytes(flags: list) -> tuple[int, int]:
    """(bytes autograd keeps of one training forward besides the offloaded copies, bytes offloaded)."""
    t = Trainer(parse_args(flags))
    model = t.models[0].module
    tokens = torch.randint(0, 256, (2, 64))
    kept, _ = saved_storage_bytes(lambda: model(tokens, labels=tokens), skip=list(model.parameters()))
    off = getattr(model.decoder, "offloader", None)
    return kept, off.offloaded_bytes if off is not None else 0


def test_offloaded_tensors_are_not_kept_by_autograd():
    """The saved-tensor hooks of the offloaded points take those tensors: autograd keeps less, by about what
    went to the host (tensors the forward saves outside the points, and shared storages, stay)."""
    base = TINY + ["--train-iters", "6", *LLAMA_MOE, *NO_DROPOUT]
    without, _ = _layer_saved_bytes(base)
    kept, moved = _layer_saved_bytes(_flags(*LLAMA_MOE, *NO_DROPOUT))
    assert moved > 0 and kept < without and kept + moved >= without, (without, kept, moved)


def test_fraction_and_size_filter():
    """Of 2 layers x (qkv_linear, mlp_norm) in forward order the first half offloads: layer 0's two points;
    a size filter above every tensor offloads nothing and changes nothing."""
    t = Trainer(parse_args(_flags(modules=["qkv_linear", "mlp_norm"]) + ["--activation-offload-fraction", "0.5"]))
    layers = t.models[0].module.decoder.layers
    chosen = [(i, name) for i, layer in enumerate(layers) for m, name in offload.points_of(layer)
              if name in m.__dict__.get("offload_points", {})]
    assert chosen == [(0, "qkv_linear"), (0, "mlp_norm")]
    _, want, _ = _run(TINY + ["--train-iters", "6", "--eval-iters", "0"], 2)
    t, got, _ = _run(_flags(size=10 ** 9), 2)
    assert got == want and t.models[0].module.decoder.offloader.offloaded_bytes == 0


def test_backward_prefetches_the_group_saved_before(monkeypatch):
    """Reloading a group starts the reload of the group saved just before it in the same forward pass: backward
    prefetches the groups in reverse forward order, each once, and a new forward pass starts a new chain."""
    packed, prefetched, sizes = [], [], {}
    pack, prefetch = offload.Offloader._pack, offload.Offloader._prefetch

    def record_pack(self, g, t):
        if not packed or packed[-1] is not g:
            packed.append(g)
        out = pack(self, g, t)
        if isinstance(out, offload.Entry):
            sizes[id(g)] = sizes.get(id(g), 0) + t.numel() * t.element_size()
        return out

    def record_prefetch(self, g):
        prefetched.append(g)
        return prefetch(self, g)
    monkeypatch.setattr(offload.Offloader, "_pack", record_pack)
    monkeypatch.setattr(offload.Offloader, "_prefetch", record_prefetch)
    t = Trainer(parse_args(_flags(*NO_DROPOUT) + ["--global-batch-size", "4", "--micro-batch-size", "2"]))
    losses_of(t, 1)  # two micro-batches: two forward passes, each with its backward
    assert len(packed) == 2 * 2 * 5  # passes x layers x points (a dense model: no expert points)
    for first in (0, 10):
        one_pass = packed[first:first + 10]
        assert one_pass[0].previous is None and all(g.previous is h for g, h in zip(one_pass[1:], one_pass))
    assert prefetched == packed[8::-1] + packed[18:9:-1]
    off = t.models[0].module.decoder.offloader  # every tensor but those of each pass's last group came back ahead
    last = sizes[id(packed[9])] + sizes[id(packed[19])]
    assert last > 0 and off.prefetched_bytes == off.offloaded_bytes - last > 0


@pytest.mark.parametrize("extra, message", [
    (["--fine-grained-activation-offloading"], "needs --offload-modules"),
    (["--offload-modules", "core_attn"], "has no effect without --fine-grained-activation-offloading"),
    (["--fine-grained-activation-offloading", "--offload-modules", "attn_proj"], "attn_proj needs core_attn"),
    (["--fine-grained-activation-offloading", "--offload-modules", "fused_group_mlp"], "operation fuser"),
    (["--fine-grained-activation-offloading", "--offload-modules", "gdp_qkv"], "gated-delta-product"),
    (["--fine-grained-activation-offloading", "--offload-modules", "mlp"], "choose from attn_norm"),
    (["--fine-grained-activation-offloading", "--offload-modules", "core_attn", "--recompute-granularity", "full",
      "--recompute-method", "uniform"], "keeps nothing to offload"),
    (["--fine-grained-activation-offloading", "--offload-modules", "core_attn", "--recompute-granularity",
      "selective"], "with --recompute-modules core_attn"),
    (["--fine-grained-activation-offloading", "--offload-modules", "mlp_norm", "--recompute-granularity",
      "selective", "--recompute-modules", "layernorm"], "mlp_norm with --recompute-modules layernorm"),
    (["--fine-grained-activation-offloading", "--offload-modules", "core_attn", "--torch-compile"], "--torch-compile"),
    (["--fine-grained-activation-offloading", "--offload-modules", "core_attn", "--activation-offload-fraction",
      "1.5"], "must be in \\[0, 1\\]"),
    (["--fine-grained-activation-offloading", "--offload-modules", "core_attn", "--delta-offload-bytes-across-pp-ranks",
      "1024"], "is not implemented"),
    (["--fine-grained-activation-offloading", "--offload-modules", "core_attn", "--delay-offload-until-cuda-graph"],
     "does not run under --cuda-graph-impl local"),
])
def test_refusals(extra, message):
    with pytest.raises(ConfigError, match=message):
        parse_args(TINY + ["--train-iters", "2", *extra])
