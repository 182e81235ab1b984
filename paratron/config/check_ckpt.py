"""Checks of the checkpoint section: the format, asynchronous saves, the load strictness, retention."""
from __future__ import annotations

from .rules import need
from .values import STRICTNESS


def validate_ckpt(c) -> None:
    # Megatron's three torch.distributed.checkpoint formats (torch_dcp; fsdp_dtensor, which Megatron-FSDP requires)
    # name paratron's one sharded format, which every layout, ZeRO-3 included, saves and loads
    need(c.ckpt_format in ("torch_dist", "torch_dcp", "fsdp_dtensor"),
         f"--ckpt-format {c.ckpt_format} is not supported; paratron saves sharded torch.distributed.checkpoint "
         "checkpoints (--ckpt-format torch_dist)")
    need(not c.async_save or c.save is not None, "--async-save needs --save DIR")
    need(c.dist_ckpt_strictness in STRICTNESS,
         f"--dist-ckpt-strictness {c.dist_ckpt_strictness}: choose one of {', '.join(STRICTNESS)}")
    need(not c.use_checkpoint_args or c.load is not None or c.pretrained_checkpoint is not None,
         "--use-checkpoint-args needs --load DIR or --pretrained-checkpoint DIR")


def validate_retention(c) -> None:
    if c.save_retain_interval is None:
        return
    need(c.save_retain_interval > 0, f"--save-retain-interval must be > 0 (got {c.save_retain_interval})")
    if c.save is not None:
        need(bool(c.save_interval) and c.save_retain_interval % c.save_interval == 0,
             f"--save-retain-interval {c.save_retain_interval} must be a multiple of --save-interval "
             f"{c.save_interval}")
