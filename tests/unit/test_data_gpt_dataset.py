"""GPTDataset / BlendedDataset: the same indices and samples as megatron-core's, cache, errors."""

import os
import sys
import warnings

import numpy as np
import pytest
import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from data_helpers import (  # noqa: E402
    StubTokenizer, build_datasets, data_args, import_mcore_datasets, random_documents,
)

from paratron.data import DataError  # noqa: E402
from paratron.data import gpt_dataset as pgd  # noqa: E402
from paratron.data.blended import (  # noqa: E402
    BlendedDataset, train_valid_test_num_samples,
)
from paratron.data.gpt_dataset import get_ltor_masks_and_position_ids  # noqa: E402
from paratron.data.indexed import write_dataset  # noqa: E402
from paratron.parallel.context import document_causal_mask  # noqa: E402

MCORE = import_mcore_datasets()
needs_mcore = pytest.mark.skipif(MCORE is None, reason="megatron-core not importable")
INDEX_NAMES = ("document_index", "sample_index", "shuffle_index")


@pytest.fixture(scope="module")
def prefixes(tmp_path_factory):
    root = tmp_path_factory.mktemp("ds")
    out = []
    for name, n, seed in (("a", 120, 1), ("b", 90, 2)):
        docs = random_documents(n, seed, vocab=500, max_len=200)
        for d in docs[::7]:
            d[-1] = 499  # some EOD tokens inside documents
        write_dataset(str(root / name), docs)
        out.append(str(root / name))
    return out


def _megatron(blend=None, blend_per_split=None, split=None, sizes=None, seq=32, mock=False):
    kw = dict(random_seed=1234, sequence_length=seq, split=split, path_to_cache=None,
              tokenizer=StubTokenizer(), reset_position_ids=False, reset_attention_mask=False,
              eod_mask_loss=False)
    if not mock:
        kw.update(blend=blend, blend_per_split=blend_per_split)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        config = MCORE.gpt.GPTDatasetConfig(**kw)
        cls = MCORE.gpt.MockGPTDataset if mock else MCORE.gpt.GPTDataset
        return MCORE.Builder(cls, sizes, lambda: True, config).build()


def _same_indices(ours, theirs):
    assert type(ours).__name__ == type(theirs).__name__
    assert len(ours) == len(theirs)
    for name in INDEX_NAMES:
        a, b = np.asarray(getattr(ours, name)), getattr(theirs, name)
        assert a.dtype == b.dtype, name
        assert np.array_equal(a, b), name


def _same_samples(ours, theirs, count=None):
    for i in range(len(ours) if count is None else count):
        a, b = ours[i], theirs[i]
        assert torch.equal(a["tokens"], b["tokens"]) and torch.equal(a["labels"], b["labels"])


def _compare(ours_splits, theirs_splits):
    for ours, theirs in zip(ours_splits, theirs_splits):
        if isinstance(theirs, MCORE.gpt.GPTDataset):
            _same_indices(ours, theirs)
        else:
            assert isinstance(ours, BlendedDataset) and len(ours) == len(theirs)
            assert np.array_equal(ours.dataset_index, theirs.dataset_index)
            assert np.array_equal(ours.dataset_sample_index, theirs.dataset_sample_index)
            for mine, other in zip(ours.datasets, theirs.datasets):
                _same_indices(mine, other)
        _same_samples(ours, theirs)


@needs_mcore
@pytest.mark.parametrize("train_iters", [20, 400])  # one epoch; many, with a separate last one
def test_single_dataset_with_split_matches_megatron(prefixes, tmp_path, train_iters):
    args = data_args(data_path=[prefixes[0]], split="90,7,3", train_iters=train_iters,
                     data_cache_path=str(tmp_path))
    ours = build_datasets(args, StubTokenizer())
    theirs = _megatron(blend=([prefixes[0]], None), split="90,7,3",
                       sizes=train_valid_test_num_samples(args.train))
    _compare(ours, theirs)


@needs_mcore
@pytest.mark.parametrize("weights", [(0.3, 0.7), None])
def test_blend_of_two_matches_megatron(prefixes, tmp_path, weights):
    data_path = ([str(weights[0]), prefixes[0], str(weights[1]), prefixes[1]] if weights
                 else prefixes)
    args = data_args(data_path=data_path, split="80,15,5", train_iters=60,
                     data_cache_path=str(tmp_path))
    ours = build_datasets(args, StubTokenizer())
    theirs = _megatron(blend=(prefixes, list(weights) if weights else None), split="80,15,5",
                       sizes=train_valid_test_num_samples(args.train))
    _compare(ours, theirs)


@needs_mcore
def test_per_split_paths_match_megatron(prefixes, tmp_path):
    args = data_args(train_data_path=["1", prefixes[0], "2", prefixes[1]],
                     valid_data_path=[prefixes[1]], test_data_path=None,
                     data_cache_path=str(tmp_path))
    ours = build_datasets(args, StubTokenizer())
    sizes = train_valid_test_num_samples(args.train)
    theirs = _megatron(blend_per_split=[(prefixes, [1.0, 2.0]), ([prefixes[1]], None), None],
                       sizes=sizes)
    assert ours[2] is None and theirs[2] is None
    _compare(ours[:2], theirs[:2])


@needs_mcore
def test_mock_matches_megatron():
    # Megatron's builder always splits mock data 1,1,1 (it replaces --split); paratron applies --split,
    # so the same documents and samples come out for --split 1,1,1.
    args = data_args(mock_data=True, train_iters=10, eval_iters=1, split="1,1,1")
    ours = build_datasets(args, StubTokenizer())
    theirs = _megatron(mock=True, sizes=train_valid_test_num_samples(args.train))
    for mine, other in zip(ours, theirs):
        _same_indices(mine, other)
        _same_samples(mine, other, count=8)


@needs_mcore
@pytest.mark.parametrize("flags", [(True, False, False), (False, True, False),
                                   (False, False, True), (True, True, True)])
def test_masks_and_positions_match_megatron(flags):
    tokens = torch.tensor([5, 7, 9, 2, 3, 9, 9, 4, 1, 9, 6])
    ours = get_ltor_masks_and_position_ids(tokens, 9, *flags)
    theirs = MCORE.gpt._get_ltor_masks_and_position_ids(tokens, 9, *flags, True)
    assert torch.equal(ours[1], theirs[1]) and ours[1].dtype == torch.float32
    assert torch.equal(ours[2], theirs[2]) and ours[2].dtype == torch.int64
    if flags[1]:
        assert torch.equal(ours[0], theirs[0]) and ours[0].dtype == torch.bool
    else:
        assert ours[0] is None


def test_sample_fields(prefixes):
    plain = build_datasets(data_args(data_path=[prefixes[0]]), StubTokenizer())
    sample = plain[0][3]
    assert set(sample) == {"tokens", "labels", "loss_mask", "position_ids"}
    assert sample["tokens"].shape == (32,) and sample["tokens"].dtype == torch.int64
    assert torch.equal(sample["tokens"][1:], sample["labels"][:-1])
    args = data_args(data_path=[prefixes[0]], reset_attention_mask=True, eod_mask_loss=True)
    reset = build_datasets(args, StubTokenizer())[0][3]
    assert reset["document_ids"].shape == (32,) and reset["document_ids"].dtype == torch.int64
    megatron_mask = get_ltor_masks_and_position_ids(reset["tokens"], 499, False, True, False)[0]
    assert torch.equal(document_causal_mask(reset["document_ids"][None])[0], ~megatron_mask)  # the same pattern
    assert reset["document_ids"][-1] > 0  # the sample holds more than one document
    assert torch.equal(reset["loss_mask"], (reset["tokens"] != 499).float())


def test_cache_files_reuse_and_ranks(prefixes, tmp_path, monkeypatch):
    cache = tmp_path / "cache"
    args = data_args(data_path=[prefixes[0]], data_cache_path=str(cache))
    events = []
    first = build_datasets(args, StubTokenizer(), rank=0,
                                            barrier=lambda: events.append("barrier"))
    assert events == ["barrier"]
    names = sorted(os.listdir(cache))
    assert len(names) == 12  # 3 splits x (description + 3 indices)
    for split in ("train", "valid", "test"):
        for kind in INDEX_NAMES:
            assert any(n.endswith(f"-GPTDataset-{split}-{kind}.npy") and len(n.split("-")[0]) == 32
                       for n in names)

    def no_build(*a, **k):
        raise AssertionError("indices rebuilt instead of loaded from the cache")

    monkeypatch.setattr(pgd, "build_gpt_indices", no_build)
    second = build_datasets(args, StubTokenizer(), rank=1,
                                             barrier=lambda: events.append("wait"))
    assert events == ["barrier", "wait"]
    for a, b in zip(first, second):
        for name in INDEX_NAMES:
            assert np.array_equal(getattr(a, name), getattr(b, name))
    default = data_args(data_path=[prefixes[1]])  # Megatron's default place: PREFIX/cache/...
    monkeypatch.undo()
    build_datasets(default, StubTokenizer())
    assert os.listdir(os.path.join(prefixes[1], "cache", "GPTDataset_indices"))


def test_split_without_documents_is_a_clear_error(tmp_path, capfd):
    """An empty training split is an error; an empty validation or test split a warning (left out)."""
    write_dataset(str(tmp_path / "tiny"), random_documents(10, 5))
    args = data_args(data_path=[str(tmp_path / "tiny")], split="1,98,1")
    with pytest.raises(DataError) as info:
        build_datasets(args, StubTokenizer())
    msg = str(info.value)
    assert "train split" in msg and "no documents" in msg and "tiny" in msg and "\n" not in msg
    train, valid, test = build_datasets(data_args(data_path=[str(tmp_path / "tiny")], split="98,1,1"), StubTokenizer())
    assert train is not None and valid is None and test is None
    assert "WARNING" in capfd.readouterr().err


def test_sizes_and_missing_splits(prefixes):
    assert train_valid_test_num_samples(data_args(train_iters=20, global_batch_size=8,
                                                  eval_interval=10, eval_iters=2).train) == [160, 48, 16]
    assert train_valid_test_num_samples(data_args(train_samples=1000).train)[0] == 1000
    train, valid, test = build_datasets(
        data_args(data_path=[prefixes[0]], split="100,0,0"), StubTokenizer())
    assert len(train) >= 160 and valid is None and test is None
    _, valid, test = build_datasets(
        data_args(data_path=[prefixes[0]], eval_iters=0), StubTokenizer())
    assert valid is None and test is None
    with pytest.raises(DataError):
        build_datasets(data_args(), StubTokenizer())
