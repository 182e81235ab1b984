"""The checkpoints of the Trainer (a mixin of paratron.train.loop.Trainer): what a training checkpoint
holds of this rank (model, optimizer, random generators, the delayed FP8 recipe's amax histories), saving
it under --save (in the background with --async-save), resuming from --load in any parallel layout, and
the save Megatron makes when the batch-size schedule changes the micro-batch count. The format is
paratron/checkpoint/sharded.py and state.py."""
from __future__ import annotations

from pathlib import Path
from typing import Optional

import torch

from ..checkpoint import megatron, sharded
from ..checkpoint import megatron_buckets as buckets
from ..checkpoint import megatron_state as mstate
from ..checkpoint import state as cstate
from ..checkpoint.compat import check_model_config
from ..checkpoint.pieces import replicated_row
from ..checkpoint.retention import Retention
from ..checkpoint.strictness import apply_strictness
from ..checkpoint.tokenizer_files import save_tokenizer
from .. import fp8
from ..parallel.random import rng_state, set_rng_state
from ..parallel.zero import sharded_model_views
from .distributed import checkpoint_group, host_memory_available, local_processes


class Checkpointing:
    pending_save: Optional[sharded.AsyncSave] = None  # the --async-save in flight

    def _init_checkpointing(self) -> None:
        self.pending_save = None
        self._pinned: dict = {}  # reused pinned CPU buffers of --async-save
        self.ckpt_group = checkpoint_group(self.cfg)  # checkpoint collectives run on their own group
        if self.cfg.ckpt.save:  # (Megatron's scripts often --save where they --load; its tracker must survive)
            megatron.refuse_save_into(Path(self.cfg.ckpt.save))

    def _ckpt_pieces(self, optim: bool, rng: Optional[dict], masters_from: Optional[str] = None,
                     model_prefix: Optional[dict] = None, amax: Optional[torch.Tensor] = None) -> list:
        pieces = cstate.model_pieces(self.models, self.dims, model_prefix)
        if optim:
            cstate.ensure_adam_state(self.optimizer)
            pieces += cstate.optimizer_pieces(self.optimizer, self.models, self.dims, masters_from)
        if rng is not None:
            pieces += cstate.rng_pieces(rng, self.dims)
        if amax is not None:  # the delayed FP8 recipe's amax histories, one row per rank
            pieces.append(replicated_row(cstate.FP8_HISTORY, amax, self.dims.rank, self.dims.world_size))
        return pieces

    def _layout(self) -> dict:
        return cstate.layout(self.dims, self.cfg.parallel.virtual_pipeline_model_parallel_size)

    def _rng_states(self) -> dict:
        states = rng_state(self.device)
        par = self.models[0].module.par
        if par.rng is not None:
            states["tp_region"] = par.rng.state
        if par.expert_rng is not None:  # --moe-router-force-load-balancing
            states["expert_region"] = par.expert_rng.state
        return states

    def save(self) -> Path:
        """Save a checkpoint of this iteration under --save (in the background with --async-save)."""
        c = self.cfg.ckpt
        self.guard.check()  # never a checkpoint of a step whose loss or gradients are not finite
        self.wait_for_save()
        self._fold_pending_skips()
        pieces = self._ckpt_pieces(not c.no_save_optim, None if c.no_save_rng else self._rng_states(),
                                   amax=fp8.histories(fp8.delayed_states(self.models)))
        self.optimizer.settle_checkpoint_views(loaded=False)  # (the pieces keep what they need)
        common = {"consumed_samples": self.consumed_samples, "skipped_iterations": self.skipped,
                  "scheduler": self.scheduler.state_dict(),
                  "optimizer": None if c.no_save_optim else {"step": cstate.adam_step(self.optimizer),
                                                             "scaler": self.optimizer.scaler.state_dict()},
                  "rng": not c.no_save_rng, "layout": self._layout(), "config": self.cfg.to_dict()}
        if self.dims.rank == 0:  # the tokenizer's files beside the weights (generate / serve find them)
            save_tokenizer(c.save, self.cfg.data)
        keep = Retention(c.ckpt_keep_last, c.save_retain_interval)  # which older checkpoints the save removes
        if c.async_save:
            it = self.iteration

            def done(path: Path, seconds: float) -> None:
                self.log.print(f" saved checkpoint at iteration {it:7d} to {path} (in the background, {seconds:.1f} s)")
            self.pending_save = sharded.AsyncSave(c.save, it, pieces, common, self.ckpt_group, keep,
                                                  self._pinned, done)
            path = sharded.iter_dir(c.save, it)
        else:
            path = sharded.save(c.save, self.iteration, pieces, common, self.ckpt_group, keep)
            self.log.print(f" saved checkpoint at iteration {self.iteration:7d} to {path}")
        if self.progress is not None:
            self.progress.saved(self.iteration, self.consumed_samples)
        return path

    def wait_for_save(self) -> None:
        """Block until a background save has finished (its error, if any, is raised here)."""
        if self.pending_save is not None:
            pending, self.pending_save = self.pending_save, None
            pending.wait()

    def _to_load(self, root: Optional[str]) -> tuple[Optional[Path], bool]:
        """(the checkpoint directory to load or None, whether as --finetune): the latest under ``root`` (--load);
        where there is none, the latest under --pretrained-checkpoint, as --finetune (Megatron's rule)."""
        c = self.cfg.ckpt
        d = self._find(root, c.finetune) if root else None
        if d is not None or not c.pretrained_checkpoint:
            return d, c.finetune
        d = self._find(c.pretrained_checkpoint, True)
        if d is None:
            raise sharded.CheckpointError(f"no checkpoint found in {root or '(no --load)'} nor in "
                                          f"--pretrained-checkpoint {c.pretrained_checkpoint}")
        self.log.print(f" no checkpoint found in {root or '(no --load)'}; fine-tuning from --pretrained-checkpoint {d}")
        return d, True

    def _find(self, root: str, finetune: bool) -> Optional[Path]:
        """The checkpoint directory under ``root`` (sharded.find_checkpoint), or the iteration directory of
        Megatron-LM's own checkpoint there (torch_dist or its legacy torch format)."""
        step = self.cfg.ckpt.ckpt_step
        found = megatron.locate(Path(root), step)
        if found is not None:
            return found[0]
        return sharded.find_checkpoint(root, self.ckpt_group, self.log.print, step)

    def _load_megatron(self, d: Path, finetune: bool) -> None:
        """Megatron-LM's torch_dist checkpoint ``d``, read in this run's layout (checkpoint/megatron.py: its names,
        its stacked layers): the model weights, and, to resume (not --finetune, not a release checkpoint), its
        optimizer state, LR schedule position, loss scale, iteration and consumed samples (megatron_state.py)."""
        common, m, rows = megatron.dist_common(d)
        self._check_megatron_config(d, m, rows)
        shapes = sharded.tensor_shapes(d)
        finetune = finetune or d.name == "release"  # (Megatron: a release checkpoint starts at iteration 0)
        optim = not (finetune or self.cfg.ckpt.no_load_optim)
        if optim:
            common = mstate.with_objects(common, d)
            mstate.check_resumable(d, common, shapes, self.cfg.optim.optimizer)
        pieces, checks = self._megatron_pieces(d, common, shapes, optim)
        try:
            sharded.load(d, pieces, self.ckpt_group)
            if checks is not None:
                buckets.verify(checks, self.ckpt_group, shapes["embedding.word_embeddings.weight"][1],
                               not self.optimizer.mixed)
        finally:
            self.optimizer.settle_checkpoint_views(loaded=optim)
        self._megatron_position(d, common, optim, finetune)

    def _megatron_position(self, d: Path, common: dict, optim: bool, finetune: bool) -> None:
        """After Megatron checkpoint ``d``'s tensors are loaded: Adam's step, loss scale, LR schedule (``optim``),
        iteration and consumed samples from its ``common`` state (torch_dist's common.pt, or a legacy rank file's)."""
        iteration, consumed = mstate.position(common)
        if not optim:
            self.optimizer.reload_masters()
            if finetune:
                self.log.print(f" loaded the model weights of Megatron-LM's checkpoint {d} (iteration {iteration}) "
                               "for fine-tuning")
                return
        else:
            self._restore_optimizer(mstate.adam_step(common), mstate.scaler_state(common),
                                    mstate.scheduler_state(common))
        self.iteration, self.consumed_samples, self.skipped = iteration, consumed, 0
        self.log.print(f" resumed from Megatron-LM's checkpoint {d} at iteration {iteration} ({consumed} samples"
                       f"{'' if optim else ', optimizer state not loaded'}); the random generators restart from "
                       "--seed (Megatron's generator states are not paratron's)")

    def _load_megatron_legacy(self, d: Path, finetune: bool) -> None:
        """Megatron-LM's legacy checkpoint ``d`` (``--ckpt-format torch``): its weights (any layout, as converted)
        and, to resume, its plain optimizer's state (megatron_legacy_state.py), read into this run's layout."""
        from ..checkpoint import megatron_legacy_state as lstate
        lstate.check_memory(d, local_processes(), host_memory_available())
        finetune = finetune or d.name == "release"
        optim = not (finetune or self.cfg.ckpt.no_load_optim)
        first = lstate.first_file(d)
        common = lstate.top_level(first[1])
        args = megatron._args(common.get("args"))
        bucketed = optim and lstate.distributed(d, args)
        if optim and not bucketed:
            common, state = lstate.read(d, self.cfg.optim.optimizer, first)
            m = megatron.model_config(args)
        else:
            del first  # (the conversion's reader reads every rank file itself)
            if bucketed:
                lstate.check_distributed(d, common, self.cfg.optim.optimizer)
                buckets.check_layout(args, self.dims, self.cfg.parallel.virtual_pipeline_model_parallel_size)
            m, state, _, _, _ = megatron.read(d.parent, None if d.name == "release" else int(d.name[len("iter_"):]))
            state = {f"model.{k}": v for k, v in state.items()}
        self._check_megatron_config(d, m, state["model.embedding.word_embeddings.weight"].shape[0])
        masters = any(k.startswith("optimizer.fp32_param.") for k in state)
        prefix = {k: "optimizer.fp32_param." for p, k in cstate.param_keys(self.models).items()
                  if p.dtype == torch.float32 and masters}  # fp32 weights from Megatron's fp32 mains
        from_model = "model." if optim and self.optimizer.mixed and not masters else None
        pieces, checks = self._ckpt_pieces(optim and not bucketed, None, from_model, prefix), None
        try:
            if bucketed:
                flat = lstate.bucket_state(d, args, self.dims)
                more, checks = self._bucket_pieces(d, args, {k: (tuple(v.shape), v.dtype) for k, v in flat.items()})
                pieces, state = pieces + more, {**state, **flat}
            lstate.fill(pieces, state, d)
            if checks is not None:
                buckets.verify(checks, self.ckpt_group, state["model.embedding.word_embeddings.weight"].dtype,
                               not self.optimizer.mixed)
        finally:
            self.optimizer.settle_checkpoint_views(loaded=optim)
        self._megatron_position(d, common, optim, finetune)

    def _check_megatron_config(self, d: Path, m, rows: int) -> None:
        """This run's model must be the one Megatron checkpoint ``d`` saved (model config ``m``, ``rows`` vocabulary
        rows), checked before any tensor is read into it."""
        from ..config import Config, DataConfig
        saved = {"config": Config(model=m, data=DataConfig(vocab_size=rows)).to_dict(), "converted_from": "megatron"}
        check_model_config(saved, self.cfg, d, self.log.print)

    def _megatron_pieces(self, d: Path, common: dict, shapes: dict, optim: bool) -> tuple[list, Optional[list]]:
        """(this rank's pieces of Megatron checkpoint ``d``, the checks of its bucketed optimizer state or None)."""
        bucketed = optim and mstate.sharding_type(common) == "dp_reshardable"
        masters = mstate.master_prefix(shapes)
        prefix = {k: "optimizer.fp32_param." for p, k in cstate.param_keys(self.models).items()
                  if p.dtype == torch.float32 and masters is not None}  # fp32 weights from Megatron's fp32 mains
        from_model = "model." if optim and self.optimizer.mixed and masters is None else None
        pieces = megatron.dist_pieces(self._ckpt_pieces(optim and not bucketed, None, from_model, prefix), d,
                                      mstate.prefixes(shapes))
        if not bucketed:
            return pieces, None
        more, checks = self._bucket_pieces(d, megatron._args(common.get("args")), shapes)
        return pieces + more, checks

    def _bucket_pieces(self, d: Path, args: dict, shapes: dict) -> tuple[list, list]:
        """(pieces, checks) of this rank's optimizer shards in Megatron's distributed optimizer buckets ``shapes``
        (megatron_buckets.py), saved with ``args``."""
        buckets.check_layout(args, self.dims, self.cfg.parallel.virtual_pipeline_model_parallel_size)
        legacy_experts = args.get("moe_grouped_gemm") and args.get("moe_use_legacy_grouped_gemm")
        if sharded_model_views(self.models) or legacy_experts or megatron.hybrid.is_hybrid(args):
            raise sharded.CheckpointError(f"{d}: Megatron's dp_reshardable optimizer state is not read with ZeRO-3, "
                                          f"into legacy grouped experts or for a hybrid model; {buckets.FIX}")
        cstate.ensure_adam_state(self.optimizer)
        chunks = [[(k, p) for p, k in cstate.param_keys([m]).items()] for m in self.models]
        more, checks = buckets.pieces(cstate.adam_shards(self.optimizer), chunks, shapes, self.dims,
                                      bool(args.get("moe_grouped_gemm")), self.optimizer.mixed,
                                      args.get("transformer_impl", "transformer_engine") == "transformer_engine")
        return more, checks

    def _restore_optimizer(self, step: int, scaler: Optional[dict], schedule: Optional[dict]) -> None:
        """After the optimizer's tensors are loaded: Adam's step, the loss scale and the LR schedule's position (each
        kept as it is where the checkpoint has none), and the LR they give."""
        cstate.set_adam_step(self.optimizer, step)
        if scaler is not None:
            self.optimizer.scaler.load_state_dict(scaler)
        if schedule is not None:
            self.scheduler.resume(schedule, self.cfg.optim)
        self.optimizer.set_lr(*self.scheduler.lrs())
        self.optimizer.reload_offloaded()  # an fp32 model's offloaded masters: from the loaded weights

    def load(self, root: Optional[str]) -> None:
        """Resume from the latest complete checkpoint under ``root`` (--load), in any parallel layout; where there is
        none, fine-tune from the latest under --pretrained-checkpoint (weights only, as --finetune), as Megatron."""
        c = self.cfg.ckpt
        d, finetune = self._to_load(root)
        if d is None:
            if c.exit_on_missing_checkpoint:
                raise sharded.CheckpointError(f"no checkpoint found in {root} (--exit-on-missing-checkpoint)")
            self.log.print(f" no checkpoint found in {root}; training from scratch")
            return
        fmt = megatron.checkpoint_format(d)
        if fmt == "torch_dist":
            return self._load_megatron(d, finetune)
        if fmt == "torch":
            return self._load_megatron_legacy(d, finetune)
        common = sharded.read_common(d)
        check_model_config(common, self.cfg, d, self.log.print)  # before any tensor is read
        saved = sharded.tensor_shapes(d)
        same_layout = common.get("layout") == self._layout()
        optim = not (finetune or c.no_load_optim) and common.get("optimizer") is not None
        rng = not (finetune or c.no_load_rng) and bool(common.get("rng"))
        if rng and not same_layout:
            self.log.print(f" WARNING: {d} was saved with another parallel layout ({common.get('layout')}): "
                           "the random generators restart from --seed")
            rng = False
        # fp32 weights come from fp32 masters when the checkpoint has them; masters from fp32 weights
        # when it has none (saved without mixed precision).
        masters = "model." if self.optimizer.mixed and not any(k.startswith("optimizer.fp32_param.") for k in saved) \
            else None
        prefix = {k: "optimizer.fp32_param." for p, k in cstate.param_keys(self.models).items()
                  if p.dtype == torch.float32 and f"optimizer.fp32_param.{k}" in saved}
        states = self._rng_states() if rng else None  # overwritten by the load
        amax = self._amax_target(saved, same_layout)
        pieces = apply_strictness(self._ckpt_pieces(optim, states, masters, prefix, amax), saved,
                                  c.dist_ckpt_strictness, self.log.print, self.ckpt_group)
        try:
            sharded.load(d, pieces, self.ckpt_group)
        except BaseException:
            self.optimizer.settle_checkpoint_views(loaded=False)
            raise
        self.optimizer.settle_checkpoint_views(loaded=optim)
        if amax is not None:
            fp8.set_histories(fp8.delayed_states(self.models), amax)
        if optim:
            opt = common["optimizer"]
            self._restore_optimizer(int(opt["step"]), opt["scaler"], common["scheduler"])
        else:
            self.optimizer.reload_masters()
        if finetune:
            self.log.print(f" loaded weights from {d} (iteration {common['iteration']}) for fine-tuning")
            return
        self.iteration, self.consumed_samples = int(common["iteration"]), int(common["consumed_samples"])
        self.skipped = int(common.get("skipped_iterations", 0))
        if states is not None:  # (the TP-region state was loaded in place: it is the tracker's own tensor)
            set_rng_state(states, self.device)
        self.log.print(f" resumed from {d} at iteration {self.iteration} ({self.consumed_samples} samples)")

    def _amax_target(self, saved: dict, same_layout: bool) -> Optional[torch.Tensor]:
        """Where to load the delayed FP8 recipe's amax histories into; None (they restart) when this
        run has none or the checkpoint has none of this shape (another layout or recipe, a bf16 run)."""
        flat = fp8.histories(fp8.delayed_states(self.models))
        if flat is None:
            return None
        if same_layout and saved.get(cstate.FP8_HISTORY, ((),))[0] == (self.dims.world_size, flat.numel()):
            return torch.empty_like(flat)
        self.log.print(" the checkpoint has no FP8 amax history for this layout and recipe: it restarts")
        return None

    def _save_on_batch_change(self, last_saved: Optional[int]) -> Optional[int]:
        """As Megatron: with --save, a checkpoint whenever the batch-size schedule (--rampup-batch-size,
        --step-batch-size-schedule) changes the micro-batch count. Returns the last saved iteration."""
        micro, self._micro = self._micro, self.num_microbatches
        if micro != self._micro and self.cfg.ckpt.save and last_saved != self.iteration:
            self.save()
            return self.iteration
        return last_saved
