"""Blends and the trainer's entry point, `build_train_valid_test_datasets(data, tokenizer, seq_length,
seed, num_samples)`.

Data flags (Megatron's, fields of the config's `data` section, a `paratron.config.DataConfig`):
- `data_path`: `[w1] p1 [w2 p2 ...]`, split three ways by `split` (default "969,30,1");
- `train_data_path` / `valid_data_path` / `test_data_path`: a blend per split, each used whole;
- `mock_data`: synthetic documents (no files), split by `--split` as Megatron's pretrain_gpt.py does;
- `sft`: the paths are JSONL files of conversations, split by line (paratron/data/sft.py).

Sample counts (`train_valid_test_num_samples(cfg.train)`): train = train_samples or train_iters *
global_batch_size; valid = (train_iters // eval_interval + 1) * eval_iters * the evaluation batch; test =
eval_iters * the evaluation batch (--eval-global-batch-size, default --global-batch-size). A split with
zero width or zero samples is None.

A weighted blend asks each member for ceil(ceil(n * w) * 1.005) samples and draws
sum(ceil(n * w)) samples from them, sample i from argmax_d(w_d * max(i, 1) - taken_d). An
unweighted blend of several prefixes weighs each by its one-epoch length.

With torch.distributed initialised (or given `rank` and `barrier`), rank 0 builds and caches the
indices first, then the other ranks load them.
"""

from __future__ import annotations

import json
import sys
from functools import partial
from typing import Callable, List, Optional, Sequence, Tuple

import numpy as np
import torch

from paratron.data.checks import check_token_ids
from paratron.data.errors import DataError
from paratron.data.fim import FIMTransform, GPTFIMDataset
from paratron.data.gpt_dataset import (
    GPTDataConfig, GPTDataset, MockGPTDataset, MockIndexedData, cached_build,
)
from paratron.data.indexed import IndexedDataset
from paratron.data.sft import ConversationTokenizer, SFTDataset, read_jsonl
from paratron.data.indices import (
    BLEND_SURPLUS, SPLIT_NAMES, blend_sizes, build_blending_indices, normalize, parse_split,
    split_bounds, split_range,
)


class BlendedDataset(torch.utils.data.Dataset):
    """`size` samples drawn from `datasets` in proportion to `weights`."""

    def __init__(self, datasets: Sequence, weights: Sequence[float], size: int, split_name: str,
                 cache_dir: Optional[str], allow_build: bool = True):
        self.datasets = list(datasets)
        self.weights = normalize(weights)
        self.size = int(size)
        self.split_name = split_name
        description = json.dumps(
            {"class": "BlendedDataset", "datasets": [d.description for d in self.datasets],
             "split": split_name, "weights": self.weights, "size": self.size}, indent=4)
        self.description = description
        self.dataset_index, self.dataset_sample_index = cached_build(
            cache_dir, description, "BlendedDataset", split_name,
            ("dataset_index", "dataset_sample_index"),
            lambda: build_blending_indices(self.weights, self.size), allow_build,
        )
        counts = np.bincount(np.asarray(self.dataset_index), minlength=len(self.datasets))
        for d, (count, dataset) in enumerate(zip(counts, self.datasets)):
            if count > len(dataset):
                raise DataError(
                    f"{dataset.path_prefix}: the {split_name} blend needs {count} samples from it "
                    f"but it has {len(dataset)}"
                )

    def __len__(self) -> int:
        return self.size

    def __getitem__(self, idx: int):
        d = int(self.dataset_index[idx])
        return self.datasets[d][int(self.dataset_sample_index[idx])]


def parse_blend(paths) -> Tuple[List[str], Optional[List[float]]]:
    """`[w1, p1, w2, p2, ...]` -> (prefixes, weights); `[p1, p2, ...]` -> (prefixes, None)."""
    if isinstance(paths, str):
        paths = paths.split()
    paths = [str(p) for p in paths]
    if not paths:
        raise DataError("--data-path: empty")
    if len(paths) % 2 == 0:
        try:
            weights = [float(w) for w in paths[0::2]]
        except ValueError:
            weights = None
        if weights is not None:
            if any(w <= 0 for w in weights):
                raise DataError(f"--data-path {' '.join(paths)}: weights must be positive")
            return [p.strip() for p in paths[1::2]], weights
    return [p.strip() for p in paths], None


def train_valid_test_num_samples(tr) -> List[int]:
    """Samples of each split for the training section `tr` (a resolved `paratron.config.TrainConfig`)."""
    gbs = int(tr.global_batch_size)
    train_iters, train_samples = tr.train_iters, tr.train_samples
    if train_samples:
        train = int(train_samples)
        train_iters = train_iters or train // gbs
    elif train_iters is not None:
        train = int(train_iters) * gbs
    else:
        raise DataError("give --train-iters or --train-samples")
    eval_iters = 100 if tr.eval_iters is None else int(tr.eval_iters)
    eval_interval = tr.eval_interval or 1000
    eval_gbs = int(getattr(tr, "eval_global_batch_size", None) or gbs)  # --eval-global-batch-size
    valid = (int(train_iters) // int(eval_interval) + 1) * eval_iters * eval_gbs
    return [train, valid, eval_iters * eval_gbs]


class EmptySplit(DataError):
    """A validation or test split without documents: a warning, the split is left out."""


class _Builder:
    def __init__(self, config: GPTDataConfig, allow_build: bool, vocab_size: Optional[int] = None, fim=None):
        self.config = config
        self.allow_build = allow_build
        self.vocab_size = vocab_size
        self.fim = fim  # a FIMTransform (--fim-data): the datasets rewrite their samples with it
        self._indexed = {}

    def indexed(self, prefix: str) -> IndexedDataset:
        """The dataset of ``prefix``, opened (sizes checked) and its token ids checked against the vocabulary once."""
        if prefix not in self._indexed:
            data = IndexedDataset(prefix, mmap_bin=self.config.mmap_bin_files)
            if self.vocab_size is not None:
                check_token_ids(data, self.vocab_size)
            self._indexed[prefix] = data
        return self._indexed[prefix]

    def single(self, prefix: str, bounds, size: Optional[int], split: int) -> GPTDataset:
        data = self.indexed(prefix)
        n = len(data)
        beg, end = split_range(bounds, n)
        if beg >= end:
            raise (EmptySplit if split else DataError)(
                f"{prefix}: the {SPLIT_NAMES[split]} split ({bounds[0]:.4f}-{bounds[1]:.4f} of "
                f"{n} documents, --split {self.config.split}) has no documents; add data or "
                "change --split"
            )
        documents = np.arange(beg, end, dtype=np.int32)
        args = (data, prefix, documents, size, SPLIT_NAMES[split], self.config, self.allow_build)
        return GPTDataset(*args) if self.fim is None else GPTFIMDataset(*args, fim=self.fim)

    def blend(self, blend, bounds, size: int, split: int):
        prefixes, weights = blend
        if len(prefixes) == 1 and weights is None:
            return self.single(prefixes[0], bounds, size, split)
        if weights is not None:
            weights = normalize(weights)
            member_sizes = blend_sizes(weights, size, BLEND_SURPLUS)
            members = [self.single(p, bounds, s, split) for p, s in zip(prefixes, member_sizes)]
            total = sum(blend_sizes(weights, size))
        else:
            members = [self.single(p, bounds, None, split) for p in prefixes]
            weights = [len(m) for m in members]
            total = min(size, sum(weights))
        cache = self.config.data_cache_path
        return BlendedDataset(members, weights, total, SPLIT_NAMES[split], cache, self.allow_build)


class _SFTBuilder(_Builder):
    """--sft: the members are JSONL files of conversations (paratron/data/sft.py), split by line."""

    def __init__(self, config: GPTDataConfig, allow_build: bool, tokenize: ConversationTokenizer):
        super().__init__(config, allow_build)
        self.tokenize = tokenize
        self._lines = {}

    def single(self, path: str, bounds, size: Optional[int], split: int) -> SFTDataset:
        if path not in self._lines:
            self._lines[path] = read_jsonl(path)
        lines = self._lines[path]
        beg, end = split_range(bounds, len(lines))
        if beg >= end:
            raise (EmptySplit if split else DataError)(
                f"{path}: the {SPLIT_NAMES[split]} split ({bounds[0]:.4f}-{bounds[1]:.4f} of {len(lines)} lines, "
                f"--split {self.config.split}) has no conversations; add data or change --split")
        return SFTDataset(lines, path, np.arange(beg, end, dtype=np.int64), size, SPLIT_NAMES[split],
                          self.tokenize, self.config.seq_length)


def _build_all(data, tokenizer, config: GPTDataConfig, sizes: Sequence[int], allow_build: bool,
               make_builder: Optional[Callable] = None):
    """``make_builder(allow_build)``: the builder of another kind of dataset (BERT's), else GPT's."""
    if make_builder is not None:
        return _build_splits(data, make_builder(allow_build), sizes, allow_build)
    if data.mock_data:
        if tokenizer.eod is None:
            raise DataError("--mock-data: the tokenizer has no EOD token")
        low = MockIndexedData(tokenizer.vocab_size, tokenizer.eod)
        out = []
        for i, bounds in enumerate(split_bounds(parse_split(data.split or "969,30,1"))):
            if not bounds:
                out.append(None)
                continue
            beg, end = split_range(bounds, len(low))
            docs = np.arange(beg, end, dtype=np.int32)
            out.append(MockGPTDataset(low, None, docs, sizes[i], SPLIT_NAMES[i], config)
                       if sizes[i] else None)
        return tuple(out)
    if getattr(data, "sft", False):
        builder = _SFTBuilder(config, allow_build, ConversationTokenizer(tokenizer, data.sft_tokenizer_prompt_format))
    else:
        fim = FIMTransform(data, tokenizer, config.seed) if getattr(data, "fim_data", False) else None
        builder = _Builder(config, allow_build, tokenizer.vocab_size, fim)
    return _build_splits(data, builder, sizes, allow_build)


def _build_splits(data, builder: _Builder, sizes: Sequence[int], allow_build: bool):
    """(train, valid, test) of the data paths: per-split blends, or one blend split by --split."""
    per_split = [getattr(data, f"{name}_data_path") for name in SPLIT_NAMES]
    if any(per_split):
        out = []
        for i, paths in enumerate(per_split):
            if not paths or not sizes[i]:
                out.append(None)
                continue
            out.append(builder.blend(parse_blend(paths), (0.0, 1.0), sizes[i], i))
        return tuple(out)
    if not data.data_path:
        raise DataError("no training data: give --data-path, --train-data-path or --mock-data")
    blend = parse_blend(data.data_path)
    split = data.split or "969,30,1"
    out = []
    for i, bounds in enumerate(split_bounds(parse_split(split))):
        try:
            out.append(builder.blend(blend, bounds, sizes[i], i) if bounds and sizes[i] else None)
        except EmptySplit as e:  # a dataset too small for its validation or test share
            if allow_build:  # the rank that builds (rank 0, or the only process) says it, once a run
                print(f" WARNING: {e}; training goes on without it", file=sys.stderr, flush=True)
            out.append(None)
    return tuple(out)


def build_train_valid_test_datasets(
    data, tokenizer, seq_length: int, seed: int, num_samples: Sequence[int],
    rank: Optional[int] = None, barrier: Optional[Callable[[], None]] = None,
    make_builder: Optional[Callable] = None,
):
    """(train, valid, test) datasets (any may be None) of the data section `data` (a
    `paratron.config.DataConfig`) for samples of `seq_length` tokens, shuffled with `seed`, with
    `num_samples` = (train, valid, test) samples (`train_valid_test_num_samples(cfg.train)`).

    Distributed: rank 0 builds and caches the indices, then `barrier()`, then the other ranks
    load them. `rank`/`barrier` default to torch.distributed's when it is initialised. `make_builder(allow_build)`:
    the builder of another kind of dataset (paratron/data/bert_dataset.py's), else GPT's."""
    config = GPTDataConfig.from_config(data, tokenizer, seq_length, seed)
    build = partial(_build_all, data, tokenizer, config, list(num_samples), make_builder=make_builder)
    if barrier is None and torch.distributed.is_available() and torch.distributed.is_initialized():
        rank, barrier = torch.distributed.get_rank(), torch.distributed.barrier
    if barrier is None or rank is None:
        return build(allow_build=True)
    if rank == 0:
        try:
            result = build(allow_build=True)
        finally:
            barrier()  # release the other ranks even on error (they then fail the same way)
        return result
    barrier()
    return build(allow_build=False)
