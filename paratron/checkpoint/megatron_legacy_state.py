"""Resuming Megatron-LM's legacy checkpoint (``--ckpt-format torch``) with its optimizer state (``--load
MEGATRON_DIR`` without ``--finetune``; megatron_state.py is the torch_dist counterpart).

Each rank file ``mp_rank_{tp:02d}[_{pp:03d}]/model_optim_rng.pt`` holds, beside the rank's ``model`` slice, the
plain optimizer's ``optimizer`` (no ``--use-distributed-optimizer``): torch's Adam ``state_dict`` whose ``state`` is
keyed by the parameter's index in Megatron's param groups (``param_groups[g]['params']``), and, for a 16-bit model,
``fp32_from_fp16_params`` (per group, the fp32 main weights of its 16-bit parameters) beside it under
``optimizer.optimizer``. Megatron (``_get_param_groups``) builds the groups over ``named_parameters()`` of the
rank's model: the parameters without weight decay (1-D ones and biases; ``wd_mult`` 0) in one group, the others in
the group before it, each in the model's order, which is the order of the rank file's ``model`` tensors. So every
state tensor gets its parameter's name; the tensors are then merged over the tensor-parallel ranks and numbered over
the pipeline stages exactly as the weights (megatron_legacy.py), and read into this run's layout. Each state tensor
must have its parameter's shape, and the fp32 main weights must round to the 16-bit weights: otherwise the
checkpoint is refused rather than its moments misplaced.

The distributed optimizer's ``distrib_optim.pt`` (one per tensor and pipeline rank: each gradient buffer's buckets
over all data-parallel ranks, coalesced) is :func:`bucket_state`, laid out by megatron_buckets.py as torch_dist's
``dp_reshardable`` buckets (same tensor and pipeline layout only; checked against the weights).

Refused by name: a virtual pipeline (several model chunks per file), MoE (its chained dense + expert optimizers),
hybrid models, and param groups beyond the two standard ones (``--decoupled-lr``, ...). Every rank reads every
rank file whole (as the conversion does), then takes its slices.
"""
from __future__ import annotations

import re
from pathlib import Path

import torch

from . import megatron_hybrid as hybrid
from .megatron import _RANK_DIR, LEGACY_FILE, _args, _torch_load, to_paratron
from .megatron_legacy import _local_experts, _merge_tp, _number_globally, _rank_dirs
from .megatron_state import check_optimizer
from .pieces import CheckpointError

DISTRIB_FILE = "distrib_optim.pt"
FIX = ("re-save it from Megatron as torch_dist (--ckpt-convert-format torch_dist), or resume with --no-load-optim "
       "(--finetune for the weights alone)")
# paratron's key prefix of each state read here (state.py)
KINDS = {"model": "model.", "exp_avg": "optimizer.exp_avg.", "exp_avg_sq": "optimizer.exp_avg_sq.",
         "fp32_param": "optimizer.fp32_param."}


def check_memory(d: Path, local_ranks: int, available: int) -> None:
    """Every rank reads the legacy checkpoint's files whole (to merge them in any layout): refuse, before reading,
    where the ``local_ranks`` processes of this node would hold more than the ``available`` host memory (bytes)."""
    size = sum(p.stat().st_size for p in d.glob("mp_rank_*/*.pt"))
    if size * local_ranks > available:
        raise CheckpointError(f"{d}: Megatron's legacy format is read whole by every rank ({size / 2**30:.1f} GiB x "
                              f"{local_ranks} processes here, {available / 2**30:.1f} GiB of host memory available); "
                              "convert it once (paratron convert --from megatron, weights only) or re-save it as "
                              "torch_dist with Megatron (--ckpt-convert-format torch_dist), which each rank reads in "
                              "slices")


def _check(d: Path, top: dict, args: dict, optimizer: str) -> None:
    """Stop with one line where this reader cannot take the optimizer state of legacy checkpoint ``d``."""
    opt = top.get("optimizer")
    check_optimizer(d, opt is not None, args, optimizer)
    what = None
    chunks = int(args.get("virtual_pipeline_model_parallel_size") or 1)
    if chunks > 1 or any(re.fullmatch(r"model\d+", k) for k in top):
        what = "the state of a virtual pipeline (several model chunks per rank file)"
    elif args.get("num_experts") or not isinstance(opt, dict):
        what = "an MoE's chained dense and expert optimizer states"
    elif hybrid.is_hybrid(args):
        what = "a hybrid (Mamba) model's optimizer state"
    elif args.get("decoupled_lr") is not None and not distributed(d, args):
        what = "the param groups of --decoupled-lr"
    if what is not None:
        raise CheckpointError(f"{d}: paratron does not read {what} from Megatron's legacy format (--ckpt-format "
                              f"torch); {FIX}")
    version = top.get("checkpoint_version")
    if isinstance(version, (int, float)) and version < 3:
        raise CheckpointError(f"{d}: checkpoint version {version}: Megatron's layouts before version 3 are not read; "
                              "load and save it once with a current Megatron-LM")


def distributed(d: Path, args: dict) -> bool:
    """Whether legacy checkpoint ``d`` holds the distributed optimizer's state (its ``distrib_optim.pt`` files)."""
    return bool(args.get("use_distributed_optimizer")) or any(d.glob(f"mp_rank_*/{DISTRIB_FILE}"))


def first_file(d: Path) -> tuple[Path, dict]:
    """(path, contents) of legacy checkpoint ``d``'s first rank file: its args, iteration, checkpoint_version,
    opt_param_scheduler and optimizer state beside that rank's model (read once: :func:`read` takes it)."""
    path = next(p / LEGACY_FILE for p in sorted(d.iterdir()) if _RANK_DIR.match(p.name) and (p / LEGACY_FILE).is_file())
    return path, _torch_load(path)


def top_level(first: dict) -> dict:
    """A rank file's state without the model's tensors."""
    return {k: v for k, v in first.items() if not re.fullmatch(r"model\d*", k)}


def check_distributed(d: Path, top: dict, optimizer: str) -> None:
    """Stop with one line where the distributed optimizer's legacy state of ``d`` is not read (see :func:`_check`;
    megatron_buckets.check_layout checks the layout)."""
    _check(d, top, _args(top.get("args")), optimizer)


def bucket_state(d: Path, args: dict, dims) -> dict:
    """This rank's distributed optimizer state of legacy checkpoint ``d``: {torch_dist's bucket tensor name
    (``optimizer.distributed.dp_group_idx_{g}.gbuf_idx_{b}.dtype_{dtypes}.bucket_idx_0.{state}``): tensor}, so that
    megatron_buckets lays it out. Megatron's ``distrib_optim.pt`` (one per tensor and pipeline rank, saved by data-
    parallel rank 0) holds per gradient buffer the concatenation of its buckets' unpadded states over all data-
    parallel ranks (``buckets_coalesced``): read as one bucket, which is what it is unless the buffer had several
    (then the layout check refuses it)."""
    name = f"mp_rank_{dims.tp_rank:02d}" + (f"_{dims.pp_rank:03d}" if dims.pp > 1 else "")
    raw = _torch_load(d / name / DISTRIB_FILE) if (d / name / DISTRIB_FILE).is_file() else None
    if not isinstance(raw, dict) or not raw.get("buckets_coalesced"):
        raise CheckpointError(f"{d / name / DISTRIB_FILE}: {'missing' if raw is None else 'not coalesced buckets'} "
                              f"(the distributed optimizer's state as Megatron-Core 0.5 and later save it); {FIX}")
    group, out = dims.tp_rank + dims.tp * dims.pp_rank, {}
    for b, by_dtype in raw.items():
        if b == "buckets_coalesced":
            continue
        for dtypes, t in by_dtype.items():
            key = f"optimizer.distributed.dp_group_idx_{group}.gbuf_idx_{b}.dtype_{dtypes}.bucket_idx_0"
            out.update({f"{key}.{s}": t[s][:t["numel_unpadded"]] for s in ("param", "exp_avg", "exp_avg_sq")})
    return out


def _no_decay(name: str, t: torch.Tensor, args: dict) -> bool:
    """Megatron's standard rule (get_standard_config_overrides): no weight decay for 1-D parameters and biases (with
    --apply-wd-to-qk-layernorm, the QK norms keep it)."""
    skip = t.dim() == 1 or name.endswith(".bias")
    if args.get("apply_wd_to_qk_layernorm"):
        skip = skip and not ("q_layernorm." in name or "k_layernorm." in name)
    return skip


def _named_states(path: Path, f: dict, args: dict) -> dict:
    """{kind: {Megatron name: tensor}} of one rank file: its model and, by parameter, Adam's moments and the fp32 main
    weights (the 16-bit parameters' from ``fp32_from_fp16_params``, an fp32 parameter's its weight)."""
    model = {k: v for k, v in f["model"].items() if isinstance(v, torch.Tensor) and "_extra_state" not in k}
    opt = f["optimizer"]
    inner = opt["optimizer"] if "fp32_from_fp16_params" in opt else opt
    mains = opt.get("fp32_from_fp16_params")
    groups, state = inner["param_groups"], inner["state"]
    wanted = [0.0 if _no_decay(k, v, args) else 1.0 for k, v in model.items()]
    if sorted({float(g.get("wd_mult", 1.0)) for g in groups}) != sorted(set(wanted)) or len(groups) != len(set(wanted)):
        raise CheckpointError(f"{path}: Megatron's param groups (wd_mult {[g.get('wd_mult') for g in groups]}) are not "
                              f"the standard weight-decay split paratron reads; {FIX}")
    out = {"model": model, "exp_avg": {}, "exp_avg_sq": {}, "fp32_param": {}}
    for g, group in enumerate(groups):
        names = [k for k, w in zip(model, wanted) if w == float(group.get("wd_mult", 1.0))]
        if len(names) != len(group["params"]):
            raise CheckpointError(f"{path}: param group {g} holds {len(group['params'])} parameters, the model "
                                  f"{len(names)} of its kind; {FIX}")
        sixteen = iter(mains[g]) if mains is not None else iter(())
        for name, index in zip(names, group["params"]):
            s, w = state.get(index, {}), model[name]
            for kind in ("exp_avg", "exp_avg_sq"):
                if kind not in s or tuple(s[kind].shape) != tuple(w.shape):
                    raise CheckpointError(f"{path}: the optimizer state of parameter {index} is not shaped as "
                                          f"{name} {tuple(w.shape)}; {FIX}")
                out[kind][name] = s[kind]
            out["fp32_param"][name] = next(sixteen) if w.dtype in (torch.float16, torch.bfloat16) else w
    return out


def _verify_mains(d: Path, state: dict) -> None:
    """The fp32 main weights must round to the 16-bit weights of the same name (else the order is not Megatron's)."""
    bad = [k for k, w in state["model"].items() if k in state["fp32_param"]
           and not torch.equal(state["fp32_param"][k].to(w.dtype), w)]
    if bad:
        raise CheckpointError(f"{d}: the fp32 main weights of Megatron's optimizer are not those of the model's "
                              f"{bad[0]} ({len(bad)} differ): its order is not the one paratron derives; {FIX}")


def read(d: Path, optimizer: str, first: tuple[Path, dict]) -> tuple[dict, dict]:
    """(the top level of a rank file: args, iteration, opt_param_scheduler, optimizer's scalars; {paratron's key:
    whole tensor}: the model and its optimizer state, under the prefixes of :data:`KINDS`) of legacy checkpoint
    ``d``, to resume with ``optimizer`` (this run's --optimizer); ``first``: :func:`first_file`'s."""
    path, top = first
    args = _args(top.get("args"))
    _check(d, top, args, optimizer)
    if distributed(d, args):
        raise CheckpointError(f"{d}: the distributed optimizer's state is read by bucket_state, not here")
    ranks = _rank_dirs(d, int(args.get("pipeline_model_parallel_size") or 1) > 1)
    chunks: dict = {kind: {} for kind in KINDS}
    swiglu, local = bool(args.get("swiglu")), _local_experts(args)
    for (pp, ep), by_tp in sorted(ranks.items()):
        per_tp = []
        for t in sorted(by_tp):
            f = top if by_tp[t] == path else _torch_load(by_tp[t])
            per_tp.append(_named_states(by_tp[t], f, args))
        for kind in KINDS:
            chunks[kind][(0, pp, ep)] = _merge_tp([s[kind] for s in per_tp], swiglu, local, {})
    merged = {kind: _number_globally(c, args) for kind, c in chunks.items()}
    _verify_mains(d, merged)
    state = {KINDS[kind] + k: v for kind, c in merged.items() for k, v in to_paratron(c).items()}
    return {k: v for k, v in top.items() if k not in ("model", "optimizer")} | {
        "optimizer": _scalars(top["optimizer"])}, state


def _scalars(opt: dict) -> dict:
    """The optimizer state's values besides the tensors by parameter: the step counts and the loss scaler."""
    inner = opt["optimizer"] if "fp32_from_fp16_params" in opt else opt
    steps = sorted({float(s["step"]) for s in inner["state"].values() if "step" in s})
    return {"steps": [{"step": s} for s in steps], "grad_scaler": opt.get("grad_scaler")}


def fill(pieces: list, state: dict, d: Path) -> None:
    """Copy each of this rank's pieces from the whole tensors ``state`` (padded vocabulary rows the checkpoint does
    not have: zeros)."""
    missing = [p.key for p in pieces if p.key not in state]
    if missing:
        raise CheckpointError(f"{d}: Megatron's legacy checkpoint has no {missing[0]} for this model")
    with torch.no_grad():
        for p in pieces:
            src = state[p.key]
            same = tuple(src.shape) == tuple(p.shape) or (p.vocab_rows and tuple(src.shape[1:]) == tuple(p.shape[1:]))
            if not same:
                raise CheckpointError(f"{d}: {p.key} is {tuple(src.shape)} in Megatron's checkpoint, {tuple(p.shape)} "
                                      "in this model")
            if p.tensor.dim() == 0:
                p.tensor.copy_(src)
                continue
            rows = max(0, min(p.tensor.shape[0], src.shape[0] - p.offsets[0]))
            idx = (slice(p.offsets[0], p.offsets[0] + rows),) + tuple(
                slice(o, o + n) for o, n in zip(p.offsets[1:], p.tensor.shape[1:]))
            p.tensor[:rows].copy_(src[idx])
            p.tensor[rows:].zero_()
