"""paratron.core's BertModel (Megatron Core's ``models.bert``): paratron's BertModel from the same seed, Megatron's
forward signature and return pair, trained through the facade's DistributedDataParallel and optimizer with TP 2 on
gloo equal to one process, sharded checkpoints, and by-name refusals."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from paratron.config import ConfigError, ModelConfig
from paratron.core import dist_checkpointing, parallel_state
from paratron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig, finalize_model_grads
from paratron.core.models.bert import BertModel, bert_layer_local_spec, bert_layer_with_transformer_engine_spec
from paratron.core.optimizer import OptimizerConfig, get_megatron_optimizer
from paratron.core.tensor_parallel import model_parallel_cuda_manual_seed
from paratron.core.transformer import TransformerConfig
from paratron.model.bert import BertModel as ParatronBert

SEQ, VOCAB = 16, 64


def config(**kw) -> TransformerConfig:
    return TransformerConfig(**dict(dict(num_layers=2, hidden_size=16, num_attention_heads=4, hidden_dropout=0.0,
                                         attention_dropout=0.0), **kw))


def batch(seed: int = 0) -> dict:
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, VOCAB, (4, SEQ), generator=g)
    mask = (torch.arange(SEQ) < torch.tensor([[SEQ], [12], [SEQ], [9]])).long()
    labels = torch.where(torch.rand(4, SEQ, generator=g) < 0.3, ids, -1) * mask - (1 - mask)
    return {"ids": ids, "mask": mask, "types": (torch.arange(SEQ) >= 8).long().expand(4, SEQ) * mask,
            "labels": labels, "order": torch.tensor([0, 1, 1, 0])}


def loss_of(model, b) -> torch.Tensor:
    """Megatron's BERT loss: the masked-LM loss over the predicted tokens plus the sentence-order loss."""
    lm, binary = model(b["ids"], b["mask"], b["types"], b["labels"])
    chosen = (b["labels"] >= 0).float()
    return (lm * chosen).sum() / chosen.sum() + F.cross_entropy(binary.float(), b["order"])


@pytest.fixture
def state():
    parallel_state.destroy_model_parallel()
    dims = parallel_state.initialize_model_parallel(tensor_model_parallel_size=1)
    model_parallel_cuda_manual_seed(123)
    yield dims
    parallel_state.destroy_model_parallel()


def test_facade_bert_is_paratrons_bert_from_the_same_seed(state):
    model = BertModel(config(), 2, bert_layer_local_spec, vocab_size=VOCAB, max_sequence_length=SEQ)
    explicit = ParatronBert(ModelConfig(model="bert", num_layers=2, hidden_size=16, num_attention_heads=4,
                                        hidden_dropout=0.0, attention_dropout=0.0, seq_length=SEQ,
                                        untie_embeddings_and_output_weights=True).resolved(max_position_embeddings=SEQ),
                            vocab_size=VOCAB, max_sequence_length=SEQ, seed=123)
    assert isinstance(model, ParatronBert) and model.transformer_config.hidden_size == 16
    a, b = model.state_dict(), explicit.state_dict()
    assert sorted(a) == sorted(b) and all(torch.equal(a[k], b[k]) for k in a)
    d = batch()
    for got, want in zip(model(d["ids"], d["mask"], d["types"], d["labels"]),
                         explicit(d["ids"], d["mask"], d["types"], d["labels"])):
        torch.testing.assert_close(got, want)
    logits, binary = model(d["ids"], d["mask"], d["types"])  # no labels: the logits, as Megatron's
    assert logits.shape == (4, SEQ, VOCAB) and binary.shape == (4, 2)
    assert BertModel(config(), 0, bert_layer_with_transformer_engine_spec, vocab_size=VOCAB, max_sequence_length=SEQ,
                     add_binary_head=False, share_embeddings_and_output_weights=True)(d["ids"], d["mask"])[1] is None


def test_facade_bert_refuses_by_name(state):
    for kw, needle in ((dict(num_tokentypes=0), "num_tokentypes=0"), (dict(return_embeddings=True), "return_embeddings"),
                       (dict(parallel_output=False), "parallel_output"), (dict(position_embedding_type="rope"), "rope")):
        with pytest.raises(ConfigError, match=needle):
            BertModel(config(), **dict(dict(num_tokentypes=2, vocab_size=VOCAB, max_sequence_length=SEQ), **kw))
    model = BertModel(config(), 2, vocab_size=VOCAB, max_sequence_length=SEQ)
    with pytest.raises(ConfigError, match="inference_params"):
        model(batch()["ids"], batch()["mask"], inference_params=object())


def test_facade_bert_sharded_checkpoint_round_trip(state, tmp_path):
    model = BertModel(config(), 2, vocab_size=VOCAB, max_sequence_length=SEQ)
    dist_checkpointing.save({"model": model.sharded_state_dict()}, tmp_path)
    saved = {k: v.clone() for k, v in model.state_dict().items()}
    with torch.no_grad():
        for p in model.parameters():
            p.zero_()
    model.load_state_dict(dist_checkpointing.load({"model": model.sharded_state_dict()}, tmp_path)["model"])
    assert all(torch.equal(saved[k], v) for k, v in model.state_dict().items())


def _train(rank: int, world: int) -> list:
    """Three steps of a BERT trained through the facade at TP = world (every rank the same batches)."""
    parallel_state.destroy_model_parallel()
    parallel_state.initialize_model_parallel(tensor_model_parallel_size=world)
    model_parallel_cuda_manual_seed(123)
    module = BertModel(config(), 2, bert_layer_local_spec, vocab_size=VOCAB, max_sequence_length=SEQ)
    model = DistributedDataParallel(config=module.config, ddp_config=DistributedDataParallelConfig(), module=module)
    optimizer = get_megatron_optimizer(OptimizerConfig(lr=1e-2), [model])
    losses = []
    for step in range(3):
        optimizer.zero_grad()
        loss = loss_of(model, batch(step))
        loss.backward()
        finalize_model_grads([model])
        optimizer.step()
        losses.append(float(loss.detach()))
    parallel_state.destroy_model_parallel()
    return losses


def test_facade_bert_tp2_matches_one_process(tmp_path):
    from tests.dist import run_ranks
    ref = _train(0, 1)
    assert ref[-1] < ref[0]
    for got in run_ranks(2, _train, tmp_dir=tmp_path):
        assert got == pytest.approx(ref, rel=1e-5)
