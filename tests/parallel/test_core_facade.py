"""paratron.core, Megatron Core's API as a facade: Megatron's simple train loop with its imports changed
(examples/run_simple_mcore_train_loop.py) trains, saves and loads under torchrun TP2 on gloo with the
one-process losses and weights; each facade piece against paratron's explicit objects; docs/library.md's
examples run."""
from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from paratron.checkpoint import sharded
from paratron.config import ConfigError, ModelConfig
from paratron.core import dist_checkpointing, parallel_state
from paratron.core.datasets import BlendedMegatronDatasetBuilder, GPTDatasetConfig, MockGPTDataset
from paratron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig, finalize_model_grads
from paratron.core.models.gpt import GPTModel, get_gpt_layer_local_spec
from paratron.core.optimizer import OptimizerConfig, get_megatron_optimizer
from paratron.core.pipeline_parallel import get_forward_backward_func
from paratron.core.tensor_parallel import model_parallel_cuda_manual_seed
from paratron.core.tokenizers import MegatronTokenizer
from paratron.core.transformer import AttnBackend, TransformerConfig
from paratron.kernels import switches
from paratron.model.gpt import GPTModel as ParatronGPT

ROOT = Path(__file__).resolve().parents[2]
LOOP = ROOT / "examples" / "run_simple_mcore_train_loop.py"
SEQ, VOCAB = 16, 64


def run_loop(nproc: int, cwd: Path) -> tuple[list[float], str]:
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT))
    r = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(nproc),
                        str(LOOP), "--tp", str(nproc)], cwd=cwd, capture_output=True, text=True, timeout=300, env=env)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-3000:]
    return [float(x) for x in re.findall(r"'lm loss': tensor\(([0-9.]+)", r.stdout)], r.stdout


@pytest.mark.slow
def test_megatron_simple_train_loop_tp2_matches_one_process(tmp_path):
    (tmp_path / "tp1").mkdir(), (tmp_path / "tp2").mkdir()
    one, out1 = run_loop(1, tmp_path / "tp1")
    two, out2 = run_loop(2, tmp_path / "tp2")
    assert len(one) == 5 and len(two) == 10 and one[-1] < one[0]
    assert two[0::2] == two[1::2]  # both TP ranks report the loss
    assert two[0::2] == pytest.approx(one, rel=1e-5)
    assert out1.count("identical weights") == 1 and out2.count("identical weights") == 2
    # the TP2 checkpoint holds the one-process model's global tensors (cut into TP shards when saved)
    d1, d2 = (sharded.find_checkpoint(tmp_path / name / "ckpt") for name in ("tp1", "tp2"))
    a, b = sharded.load_full(d1), sharded.load_full(d2)
    assert sorted(a) == sorted(b)
    for key in a:
        torch.testing.assert_close(a[key], b[key], rtol=1e-5, atol=1e-6, msg=key)


# ---- the pieces, on one process -------------------------------------------------------------------

@pytest.fixture
def state():
    parallel_state.destroy_model_parallel()
    dims = parallel_state.initialize_model_parallel(tensor_model_parallel_size=1, pipeline_model_parallel_size=1)
    model_parallel_cuda_manual_seed(123)
    yield dims
    parallel_state.destroy_model_parallel()


def config(**kw) -> TransformerConfig:
    return TransformerConfig(**dict(dict(num_layers=2, hidden_size=16, num_attention_heads=4, hidden_dropout=0.0,
                                         attention_dropout=0.0), **kw))


def test_parallel_state_getters_read_the_one_parallel_dims(state):
    assert parallel_state.model_parallel_is_initialized() and parallel_state.current_dims() is state
    assert (parallel_state.get_tensor_model_parallel_world_size(), parallel_state.get_tensor_model_parallel_rank(),
            parallel_state.get_data_parallel_world_size(), parallel_state.get_data_parallel_rank(),
            parallel_state.get_pipeline_model_parallel_world_size(),
            parallel_state.get_pipeline_model_parallel_rank()) == (1, 0, 1, 0, 1, 0)
    assert parallel_state.get_tensor_model_parallel_group() is None  # one process: no torch.distributed
    assert parallel_state.is_pipeline_first_stage() and parallel_state.is_pipeline_last_stage()
    with pytest.raises(TypeError, match="no_such_size"):
        parallel_state.initialize_model_parallel(no_such_size=2)
    parallel_state.destroy_model_parallel()
    assert not parallel_state.model_parallel_is_initialized()
    with pytest.raises(Exception, match="initialize_model_parallel"):
        parallel_state.get_tensor_model_parallel_rank()


def test_transformer_config_maps_megatron_names_and_refuses_by_name():
    m = config(layernorm_epsilon=1e-6, add_bias_linear=False, gated_linear_unit=True, activation_func=F.silu,
               num_query_groups=2, normalization="RMSNorm", use_cpu_initialization=True,
               pipeline_dtype=torch.float32, bias_dropout_fusion=True).model_config(32)
    assert (m.norm_epsilon, m.disable_bias_linear, m.swiglu, m.group_query_attention, m.num_query_groups,
            m.normalization, m.max_position_embeddings) == (1e-6, True, True, True, 2, "RMSNorm", 32)
    assert m.is_resolved
    with pytest.raises(ConfigError, match="fp32_residual_connection"):
        config(fp32_residual_connection=True)
    with pytest.raises(ConfigError, match="activation_func=relu"):
        config(activation_func=F.relu)
    with pytest.raises(TypeError, match="not_a_megatron_field"):
        config(not_a_megatron_field=1)


def test_attention_backend_and_deterministic_mode_choose_the_kernel_switches(state, monkeypatch):
    """Megatron's attention_backend (enum or name) is --attention-backend; deterministic_mode resolves the
    switches as a --deterministic-mode run does; the model built from the config holds them."""
    asked = []
    resolve = switches.resolve
    monkeypatch.setattr(switches, "resolve", lambda k, d, t, det=False: asked.append(det) or resolve(k, d, t, det))
    model = GPTModel(config=config(attention_backend=AttnBackend.unfused, deterministic_mode=True),
                     transformer_layer_spec=get_gpt_layer_local_spec(), vocab_size=VOCAB, max_sequence_length=SEQ)
    assert (model.kernels.attention_backend, asked) == ("unfused", [True])
    assert config(attention_backend="flash").kernel_config("cpu", torch.float32).attention_backend == "flash"
    assert config().kernel_config("cpu", torch.float32).kernel_cublaslt == "off"
    with pytest.raises(ConfigError, match="attention_backend='fast'.*auto, flash, fused, unfused, local"):
        config(attention_backend="fast")


def test_facade_gpt_model_is_paratrons_model_from_the_same_seed(state):
    model = GPTModel(config=config(), transformer_layer_spec=get_gpt_layer_local_spec(), vocab_size=VOCAB,
                     max_sequence_length=SEQ)
    explicit = ParatronGPT(ModelConfig(num_layers=2, hidden_size=16, num_attention_heads=4, hidden_dropout=0.0,
                                       attention_dropout=0.0, seq_length=SEQ,
                                       untie_embeddings_and_output_weights=True).resolved(max_position_embeddings=SEQ),
                           vocab_size=VOCAB, max_sequence_length=SEQ, seed=123)
    assert isinstance(model, ParatronGPT) and model.transformer_config.hidden_size == 16
    a, b = model.state_dict(), explicit.state_dict()
    assert sorted(a) == sorted(b) and all(torch.equal(a[k], b[k]) for k in a)
    tokens = torch.randint(0, VOCAB, (2, SEQ))
    torch.testing.assert_close(model(tokens, None, None, labels=tokens), explicit(tokens, labels=tokens))
    with pytest.raises(ConfigError, match="decoder_input"):
        model(tokens, None, None, torch.zeros(SEQ, 2, 16))


def test_facade_refuses_the_combined_overlap_where_megatron_does(state):
    """TransformerConfig(overlap_moe_expert_parallel_comm / delay_wgrad_compute) under config/check_moe.py's rules
    when the model is built (on one expert rank the turns have nothing to overlap; the delayed weight gradients
    need the turns); tests/parallel/test_moe_turns.py checks the rest at EP 2."""
    moe = dict(num_moe_experts=4, moe_router_topk=2, moe_ffn_hidden_size=16, moe_token_dispatcher_type="alltoall",
               moe_grouped_gemm=True)
    with pytest.raises(ConfigError, match="expert-model-parallel-size > 1"):
        GPTModel(config=config(**moe, overlap_moe_expert_parallel_comm=True), vocab_size=VOCAB, max_sequence_length=SEQ)
    with pytest.raises(ConfigError, match="delay-wgrad-compute needs --overlap-moe-expert-parallel-comm"):
        GPTModel(config=config(**moe, delay_wgrad_compute=True), vocab_size=VOCAB, max_sequence_length=SEQ)
    assert GPTModel(config=config(**moe), vocab_size=VOCAB, max_sequence_length=SEQ).config.num_experts == 4


def test_mock_dataset_samples_have_megatrons_keys(state):
    tok = MegatronTokenizer.from_pretrained(metadata_path={"library": "null-text"}, vocab_size=VOCAB)
    cfg = GPTDatasetConfig(random_seed=0, sequence_length=SEQ, reset_position_ids=False, reset_attention_mask=False,
                           eod_mask_loss=False, tokenizer=tok)
    train, valid, test = BlendedMegatronDatasetBuilder(MockGPTDataset, [100, None, None], lambda: True, cfg).build()
    assert isinstance(train, MockGPTDataset) and len(train) >= 100 and valid is None and test is None
    s = train[3]
    assert sorted(s) == ["attention_mask", "labels", "loss_mask", "position_ids", "tokens"]
    assert s["tokens"].shape == (SEQ,) and int(s["tokens"].max()) < VOCAB
    assert torch.equal(s["attention_mask"][0], torch.ones(SEQ, SEQ, dtype=torch.bool).triu(1))
    assert torch.equal(s["tokens"][1:], s["labels"][:-1])


def batches(n: int, b: int = 2) -> list[dict]:
    g = torch.Generator().manual_seed(0)
    return [{"tokens": torch.randint(0, VOCAB, (b, SEQ), generator=g),
             "labels": torch.randint(0, VOCAB, (b, SEQ), generator=g)} for _ in range(n)]


def forward_step(data_iterator, model):
    data = next(data_iterator)

    def loss_func(output):
        loss = output.float().mean()
        return loss, {"lm loss": loss.detach()}
    return model(data["tokens"], None, None, labels=data["labels"]), loss_func


def test_schedule_takes_megatrons_two_value_loss_func(state):
    model = GPTModel(config=config(), vocab_size=VOCAB, max_sequence_length=SEQ)
    data = batches(2)
    reports = get_forward_backward_func()(forward_step_func=forward_step, data_iterator=iter(data), model=model,
                                          num_microbatches=2, seq_length=SEQ, micro_batch_size=2, forward_only=False)
    assert len(reports) == 2
    got = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad()
    sum(model(d["tokens"], labels=d["labels"]).mean() / 2 for d in data).backward()
    for n, p in model.named_parameters():
        torch.testing.assert_close(got[n], p.grad, msg=n)


def steps(model, optimizer, micro_batches: int, n: int = 4):
    """``n`` training steps of Megatron's loop on the facade: (the schedule's loss reports, optimizer.step()'s
    triple) per step."""
    schedule, data = get_forward_backward_func(), batches(micro_batches)
    for _ in range(n):
        optimizer.zero_grad()
        reports = schedule(forward_step_func=forward_step, data_iterator=iter(data), model=model,
                           num_microbatches=micro_batches, seq_length=SEQ, micro_batch_size=2)
        finalize_model_grads([model])
        yield reports, optimizer.step()


def test_get_megatron_optimizer_steps_a_hand_built_model(state):
    module = GPTModel(config=config(), vocab_size=VOCAB, max_sequence_length=SEQ)
    model = DistributedDataParallel(config=module.config, ddp_config=DistributedDataParallelConfig(), module=module)
    optimizer = get_megatron_optimizer(OptimizerConfig(lr=1e-2, clip_grad=1.0), [model])
    losses = []
    for reports, (applied, norm, zeros) in steps(model, optimizer, 1):
        assert applied and norm > 0 and zeros is None
        losses.append(float(reports[0]["lm loss"]))
    assert losses[-1] < losses[0] and optimizer.param_groups[0]["lr"] == 1e-2
    with pytest.raises(ConfigError, match="learning rate"):
        get_megatron_optimizer(OptimizerConfig(), [model])


def test_ddp_config_num_buckets_and_padding(state):
    """Megatron Core's DistributedDataParallelConfig(num_buckets=..., pad_buckets_for_high_nccl_busbw=True): the
    module's parameters in that many buckets, each a multiple of 2^16 elements; both sizes at once are refused."""
    module = GPTModel(config=config(), vocab_size=VOCAB, max_sequence_length=SEQ)
    ddp = DistributedDataParallelConfig(num_buckets=3, pad_buckets_for_high_nccl_busbw=True)
    model = DistributedDataParallel(config=module.config, ddp_config=ddp, module=module)
    assert len(model.buckets) == 3 and all(b.numel % 2 ** 16 == 0 for b in model.buckets)
    with pytest.raises(ConfigError, match="without bucket_size"):
        DistributedDataParallelConfig(num_buckets=2, bucket_size=1000)
    for field, value in (("check_for_large_grads", True), ("preserve_fp32_weights", False)):
        with pytest.raises(ConfigError, match=field):
            DistributedDataParallelConfig(**{field: value})


def test_ddp_config_check_for_nan_in_grad(state):
    """check_for_nan_in_grad=True: a step whose gradients are finite passes, one with a NaN is an error."""
    module = GPTModel(config=config(), vocab_size=VOCAB, max_sequence_length=SEQ)
    model = DistributedDataParallel(config=module.config, ddp_config=DistributedDataParallelConfig(
        check_for_nan_in_grad=True), module=module)
    optimizer = get_megatron_optimizer(OptimizerConfig(lr=1e-2), [model])
    next(steps(model, optimizer, 1))
    with torch.no_grad():
        next(module.parameters()).view(-1)[0] = float("nan")
    with pytest.raises(RuntimeError, match="a gradient is NaN or infinite"):
        next(steps(model, optimizer, 1))


def test_dist_checkpointing_round_trip(state, tmp_path):
    model = GPTModel(config=config(), vocab_size=VOCAB, max_sequence_length=SEQ)
    dist_checkpointing.save({"model": model.sharded_state_dict(), "iteration": 7}, tmp_path)
    saved = {k: v.clone() for k, v in model.state_dict().items()}
    with torch.no_grad():
        for p in model.parameters():
            p.zero_()
    loaded = dist_checkpointing.load({"model": model.sharded_state_dict(), "iteration": 0}, tmp_path)
    assert loaded["iteration"] == 7
    model.load_state_dict(loaded["model"])
    assert all(torch.equal(saved[k], v) for k, v in model.state_dict().items())


def test_docs_library_examples_run(capsys):
    doc = ROOT / "docs" / "library.md"
    blocks = re.findall(r"```python\n(.*?)```", doc.read_text(), re.S)
    assert len(blocks) >= 2
    for code in blocks:
        parallel_state.destroy_model_parallel()
        exec(compile(code, str(doc), "exec"), {"__name__": "library_md"})
    parallel_state.destroy_model_parallel()
    out = capsys.readouterr().out
    assert out.count("trained: loss") == 2, out


def _facade_optimizer_run(rank: int, world: int) -> dict:
    """Four steps of get_megatron_optimizer on the facade at TP = world; the getters and the DP group."""
    parallel_state.destroy_model_parallel()
    parallel_state.initialize_model_parallel(tensor_model_parallel_size=world)
    model_parallel_cuda_manual_seed(123)
    ps = parallel_state
    out = {"tp": (ps.get_tensor_model_parallel_rank(), ps.get_tensor_model_parallel_world_size()),
           "dp": (ps.get_data_parallel_rank(), ps.get_data_parallel_world_size())}
    one = torch.ones(())
    if world > 1:  # a DP group of one rank: a collective over it must not reach the TP peer
        torch.distributed.all_reduce(one, group=parallel_state.get_data_parallel_group())
    out["dp_sum"] = float(one)
    module = GPTModel(config=config(), vocab_size=VOCAB, max_sequence_length=SEQ)
    model = DistributedDataParallel(config=module.config, ddp_config=DistributedDataParallelConfig(), module=module)
    optimizer = get_megatron_optimizer(OptimizerConfig(lr=1e-2), [model])
    out["losses"] = []
    for reports, result in steps(model, optimizer, 2):
        out["norm"] = result[1]
        out["losses"].append(sum(float(r["lm loss"]) for r in reports))
    parallel_state.destroy_model_parallel()
    return out


def test_facade_optimizer_tp2_matches_one_process(tmp_path):
    from tests.dist import run_ranks
    ref = _facade_optimizer_run(0, 1)
    got = run_ranks(2, _facade_optimizer_run, tmp_dir=tmp_path)
    assert [g["tp"] for g in got] == [(0, 2), (1, 2)] and [g["dp"] for g in got] == [(0, 1), (0, 1)]
    assert [g["dp_sum"] for g in got] == [1.0, 1.0]
    for g in got:
        assert g["losses"] == pytest.approx(ref["losses"], rel=1e-5)
        assert g["norm"] == pytest.approx(ref["norm"], rel=1e-4)


def _facade_sharded_run(rank: int, world: int, strategy: str) -> list:
    """Four steps of the facade at DP = world with Megatron-FSDP's sharding strategy (every rank the same
    micro-batches, so the averaged gradient is one process's)."""
    parallel_state.destroy_model_parallel()
    parallel_state.initialize_model_parallel(tensor_model_parallel_size=1)
    model_parallel_cuda_manual_seed(123)
    module = GPTModel(config=config(), vocab_size=VOCAB, max_sequence_length=SEQ)
    fsdp = strategy != "no_shard"
    ddp = DistributedDataParallelConfig(use_megatron_fsdp=fsdp, data_parallel_sharding_strategy=strategy,
                                        use_distributed_optimizer=fsdp)
    model = DistributedDataParallel(config=module.config, ddp_config=ddp, module=module)
    optimizer = get_megatron_optimizer(OptimizerConfig(lr=1e-2, use_distributed_optimizer=fsdp), [model])
    losses = [sum(float(r["lm loss"]) for r in reports) for reports, _ in steps(model, optimizer, 2)]
    parallel_state.destroy_model_parallel()
    return [model.sharding, losses]


@pytest.mark.parametrize("strategy,level", [("optim", 1), ("optim_grads", 2), ("optim_grads_params", 3)])
def test_facade_megatron_fsdp_strategies_match_one_process(tmp_path, strategy, level):
    """DistributedDataParallelConfig(use_megatron_fsdp=True, data_parallel_sharding_strategy=...): ZeRO-1/2/3
    on paratron's buffers through the facade, DP 2 on gloo, the one-process losses."""
    from tests.dist import run_ranks
    ref = _facade_sharded_run(0, 1, "no_shard")[1]
    for got_level, losses in run_ranks(2, _facade_sharded_run, strategy, tmp_dir=tmp_path):
        assert got_level == level and losses == pytest.approx(ref, rel=1e-5)


def test_facade_sharding_strategy_needs_fsdp_and_the_distributed_optimizer(state):
    with pytest.raises(ConfigError, match="use_megatron_fsdp=True"):
        DistributedDataParallelConfig(data_parallel_sharding_strategy="optim_grads")
    with pytest.raises(ConfigError, match="one of no_shard"):
        DistributedDataParallelConfig(use_megatron_fsdp=True, data_parallel_sharding_strategy="zero3")
    module = GPTModel(config=config(), vocab_size=VOCAB, max_sequence_length=SEQ)
    ddp = DistributedDataParallelConfig(use_custom_fsdp=True, data_parallel_sharding_strategy="optim_grads_params")
    model = DistributedDataParallel(config=module.config, ddp_config=ddp, module=module)
    assert model.sharding == 3
    with pytest.raises(ConfigError, match="use_distributed_optimizer=True"):
        get_megatron_optimizer(OptimizerConfig(lr=1e-2), [model])


def test_precision_aware_optimizer_config(state):
    """Megatron Core's OptimizerConfig(use_precision_aware_optimizer=True, exp_avg_dtype=..., ...): the moments in
    those dtypes (torch.uint8 is fp8, as in Megatron); a bf16 main gradient needs the DDP wrapper's bf16 buffers."""
    module = GPTModel(config=config(), vocab_size=VOCAB, max_sequence_length=SEQ)
    model = DistributedDataParallel(config=module.config, ddp_config=DistributedDataParallelConfig(), module=module)
    optimizer = get_megatron_optimizer(OptimizerConfig(lr=1e-2, use_precision_aware_optimizer=True,
                                                       exp_avg_dtype=torch.bfloat16, exp_avg_sq_dtype=torch.uint8),
                                       [model])
    losses = [float(reports[0]["lm loss"]) for reports, _ in steps(model, optimizer, 3)]
    assert losses[-1] < losses[0]
    adam = optimizer.optimizer.adam
    assert {s["exp_avg"].dtype for s in adam.state.values()} == {torch.bfloat16}
    assert {s["exp_avg_sq"].dtype for s in adam.state.values()} == {torch.float8_e4m3fn}
    with pytest.raises(ConfigError, match="needs --use-precision-aware-optimizer"):
        get_megatron_optimizer(OptimizerConfig(lr=1e-2, exp_avg_dtype=torch.bfloat16), [model])
    with pytest.raises(ConfigError, match="choose one of torch.float32"):
        OptimizerConfig(lr=1e-2, exp_avg_dtype=torch.int8)
    with pytest.raises(ConfigError, match="needs --bf16"):  # (this model is fp32)
        get_megatron_optimizer(OptimizerConfig(lr=1e-2, use_precision_aware_optimizer=True,
                                               main_grads_dtype=torch.bfloat16), [model])


def test_recompute_modules_and_activation_offloading(state):
    """Megatron Core's TransformerConfig(recompute_modules=..., fine_grained_activation_offloading=True,
    offload_modules=...): applied to the decoder as the command line's flags are, checked by the same rules;
    the loss is the one without them."""
    def first_loss(**extra):
        torch.manual_seed(0)
        module = GPTModel(config=config(**extra), vocab_size=VOCAB,
                          max_sequence_length=SEQ)
        model = DistributedDataParallel(config=module.config, ddp_config=DistributedDataParallelConfig(),
                                        module=module)
        optimizer = get_megatron_optimizer(OptimizerConfig(lr=1e-2), [model])
        losses = [float(reports[0]["lm loss"]) for reports, _ in steps(model, optimizer, 2)]
        return module, losses[1]  # (after one update: the gradients' doing)
    plain, want = first_loss()
    module, got = first_loss(recompute_granularity="selective", recompute_modules=["layernorm", "mlp"],
                             fine_grained_activation_offloading=True, offload_modules=["core_attn"],
                             min_offloaded_tensor_size=0)
    assert got == pytest.approx(want, rel=1e-6)
    layer = module.decoder.layers[0]
    assert layer.recompute_norms and layer.recompute_mlp and not plain.decoder.layers[0].recompute_norms
    assert module.decoder.offloader.offloaded_bytes > 0
    with pytest.raises(ConfigError, match="attn_proj needs core_attn"):
        GPTModel(config=config(fine_grained_activation_offloading=True, offload_modules=["attn_proj"]),
                 vocab_size=VOCAB, max_sequence_length=SEQ)
    with pytest.raises(ConfigError, match="choose from"):
        GPTModel(config=config(recompute_granularity="selective", recompute_modules=["nope"]), vocab_size=VOCAB,
                 max_sequence_length=SEQ)
