"""The flags of sharded data parallelism, FP8 parameter gather and optimizer offload: Megatron's spellings
parse, the combinations paratron does not implement are refused by name, and the pure helpers
(the predicted state shares, the offloaded masters) say what they should."""
import pytest
import torch

from paratron.config import ConfigError
from paratron.config.values import sharding_level
from paratron.optim.memory import predicted_state_bytes
from paratron.optim.offload import host_indices
from paratron.train.resolve import parse_args
from tests.parallel.common import tiny_config

BASE = ["--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4", "--seq-length", "32",
        "--max-position-embeddings", "32", "--micro-batch-size", "1", "--train-iters", "2", "--lr", "1e-3",
        "--mock-data", "--vocab-size", "512"]


@pytest.mark.parametrize("strategy,level", [("no_shard", 0), ("optim", 1), ("optim_grads", 2),
                                            ("optim_grads_params", 3)])
def test_megatron_fsdp_flags_parse_and_set_the_level(strategy, level):
    cfg = parse_args(BASE + ["--use-megatron-fsdp", "--data-parallel-sharding-strategy", strategy,
                             "--optimizer-cpu-offload", "--optimizer-offload-fraction", "0.25"])
    assert sharding_level(cfg.parallel) == level
    assert cfg.parallel.use_distributed_optimizer == (level >= 1)
    assert cfg.optim.optimizer_cpu_offload and cfg.optim.optimizer_offload_fraction == 0.25


@pytest.mark.parametrize("flags,message", [
    (dict(data_parallel_sharding_strategy="optim_grads"), "has no effect without --use-megatron-fsdp"),
    (dict(use_megatron_fsdp=True, data_parallel_sharding_strategy="zero3"), "must be one of no_shard"),
    (dict(use_megatron_fsdp=True, use_distributed_optimizer=True), "no_shard contradicts --use-distributed-opt"),
    (dict(use_megatron_fsdp=True, data_parallel_sharding_strategy="optim_grads_params",
          check_weight_hash_across_dp_replicas_interval=10), "hold different shards, not replicas"),
    (dict(fp8_param_gather=True, use_distributed_optimizer=True), "--fp8-param-gather needs FP8 training"),
    (dict(optimizer_offload_fraction=1.5), "--optimizer-offload-fraction must be in [0, 1]"),
    (dict(optimizer_cpu_offload=True, optimizer="muon"), "--optimizer-cpu-offload with --optimizer muon"),
    (dict(optimizer="muon", use_megatron_fsdp=True, data_parallel_sharding_strategy="optim_grads"),
     "--optimizer muon with --data-parallel-sharding-strategy optim_grads is not implemented"),
])
def test_unimplemented_combinations_are_refused_by_name(flags, message):
    with pytest.raises(ConfigError, match=message.replace("[", r"\[").replace("]", r"\]")):
        tiny_config(world_size=2, **flags)


def test_megatron_fsdp_dtype_flags_map_onto_paratrons_buffers():
    """Megatron-FSDP's example scripts: bf16 main gradients and communication set the bf16 gradient buffer,
    --ckpt-format fsdp_dtensor names paratron's one sharded format; the defaults change nothing."""
    fsdp = BASE + ["--use-megatron-fsdp", "--data-parallel-sharding-strategy", "optim_grads_params", "--bf16"]
    cfg = parse_args(fsdp + ["--megatron-fsdp-grad-comm-dtype", "bf16", "--megatron-fsdp-main-grads-dtype", "bf16",
                             "--ckpt-format", "fsdp_dtensor"])
    assert cfg.parallel.grad_reduce_in_bf16 and cfg.ckpt.ckpt_format == "fsdp_dtensor"
    plain = parse_args(fsdp + ["--megatron-fsdp-main-params-dtype", "fp32", "--megatron-fsdp-main-grads-dtype", "auto"])
    assert not plain.parallel.grad_reduce_in_bf16
    fp32 = parse_args(BASE + ["--use-megatron-fsdp", "--megatron-fsdp-main-params-dtype", "auto"])  # an fp32 model
    assert fp32.optim.megatron_fsdp_main_params_dtype == "auto"


@pytest.mark.parametrize("flags,message", [
    (["--megatron-fsdp-main-grads-dtype", "bf16", "--bf16"], "add --use-megatron-fsdp or remove them"),
    (["--use-megatron-fsdp", "--bf16", "--megatron-fsdp-main-params-dtype", "auto"],
     "--megatron-fsdp-main-params-dtype auto (master weights in bf16) is not implemented"),
    (["--use-megatron-fsdp", "--megatron-fsdp-main-grads-dtype", "fp16"], "fp16 is not implemented"),
    (["--use-megatron-fsdp", "--bf16", "--megatron-fsdp-grad-comm-dtype", "bf16"],
     "--megatron-fsdp-grad-comm-dtype bf16 with fp32 main gradients"),
    (["--use-megatron-fsdp", "--megatron-fsdp-main-grads-dtype", "bf16"], "bf16 needs --bf16"),
    (["--use-megatron-fsdp", "--megatron-fsdp-main-grads-dtype", "int8"], "choose one of fp32, bf16, fp16, auto"),
    (["--ckpt-format", "zarr"], "--ckpt-format zarr is not supported"),
])
def test_megatron_fsdp_dtype_flags_refused_where_paratron_differs(flags, message):
    with pytest.raises(ConfigError, match=message.replace("(", r"\(").replace(")", r"\)")):
        parse_args(BASE + flags)


def test_torch_fsdp2_is_refused_pointing_at_the_megatron_fsdp_flags():
    with pytest.raises(ConfigError, match="--use-torch-fsdp2.*--use-megatron-fsdp"):
        parse_args(BASE + ["--use-torch-fsdp2"])


def test_predicted_shares_divide_what_each_strategy_shards():
    n, dp = 1000, 4
    full = [predicted_state_bytes(n, dp, 0, 2, 4, mixed=True)]
    shares = [predicted_state_bytes(n, dp, level, 2, 4, mixed=True) for level in range(4)]
    assert full[0] == shares[0] and (shares[0].params, shares[0].grads, shares[0].optimizer) == (2000, 4000, 12000)
    assert (shares[1].params, shares[1].grads, shares[1].optimizer) == (2000, 4000, 3000)
    assert (shares[2].params, shares[2].grads, shares[2].optimizer) == (2000, 1000, 3000)
    assert (shares[3].params, shares[3].grads, shares[3].optimizer) == (500, 1000, 3000)


def test_offload_fraction_picks_masters_in_order_by_elements():
    masters = [torch.zeros(n) for n in (10, 30, 40, 20)]
    assert host_indices(masters, [0, 1, 2, 3], 0.0) == []
    assert host_indices(masters, [0, 1, 2, 3], 0.4) == [0, 1]  # 10 < 40, then 40: the bound is reached
    assert host_indices(masters, [0, 1, 2, 3], 1.0) == [0, 1, 2, 3]
    assert host_indices(masters, [1, 3], 0.5) == [1]  # only Adam's masters (a Muon matrix stays)
