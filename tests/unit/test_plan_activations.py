"""The planner's activation memory against the bytes autograd really saves for backward on CPU (saved-tensor
hooks, each storage counted once, parameters left out), one forward of one micro-batch through the model."""
import pytest
import torch

from paratron.plan.layout import layout_of
from paratron.plan.memory import rank_memory
from paratron.train.loop import build_dims, build_model_chunks
from tests.parallel.common import tiny_config


def saved_bytes(cfg) -> int:
    model = build_model_chunks(cfg, build_dims(cfg), torch.device("cpu"))[0]
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    seen = {}

    def pack(t):
        storage = t.untyped_storage()
        if storage.data_ptr() not in params:
            seen.setdefault(storage.data_ptr(), storage.nbytes())
        return t
    tokens = torch.randint(0, 500, (cfg.train.micro_batch_size, cfg.model.seq_length),
                           generator=torch.Generator().manual_seed(0))
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        model(tokens, labels=tokens)
    return sum(seen.values())


FULL = dict(recompute_granularity="full", recompute_method="uniform", recompute_num_layers=1)
CASES = [("gpt", {}), ("llama", {}), ("llama", dict(recompute_granularity="selective")), ("llama", FULL),
         ("llama", dict(num_layers=4, recompute_granularity="full", recompute_method="block", recompute_num_layers=2)),
         ("gpt", dict(seq_length=64, micro_batch_size=4)), ("gpt", dict(bf16=True)),
         ("llama", dict(num_experts=4, moe_router_topk=2)),
         ("llama", dict(num_layers=3, num_experts=8, moe_router_topk=2, moe_shared_expert_intermediate_size=64,
                        moe_layer_freq="[0,1,1]")),
         ("llama", dict(mtp_num_layers=2)), ("gpt", dict(mtp_num_layers=1)), ("llama", dict(mtp_num_layers=1, bf16=True)),
         ("llama", dict(mtp_num_layers=1, num_experts=4, moe_router_topk=2)),
         ("llama", dict(num_experts=4, moe_router_topk=2, moe_latent_size=16)),
         ("gpt", dict(num_experts=4, moe_router_topk=2, moe_latent_size=32, bf16=True))]


@pytest.mark.parametrize("style,extra", CASES, ids=[f"{s}-{'-'.join(e) or 'plain'}" for s, e in CASES])
def test_activation_bytes_match_saved_tensors(style, extra):
    cfg = tiny_config(style, world_size=1, **extra)
    predicted = rank_memory(cfg.model, cfg.padded_vocab_size, layout_of(cfg), 0, cfg.parallel).activations
    measured = saved_bytes(cfg)
    assert abs(predicted / measured - 1) < 0.02, (predicted, measured)
