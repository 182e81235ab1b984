"""What a training run prints and writes once it is over: the loss plot and, with --sample-prompt, the
trained model's continuation of the prompt."""
from __future__ import annotations

from pathlib import Path


def end_of_run(trainer, result: dict) -> None:
    cfg, lg = trainer.cfg, trainer.log
    plot_path = cfg.log.plot_path or (Path(cfg.log.tensorboard_dir or cfg.ckpt.save or ".") / "loss.png"
                                      if (cfg.log.tensorboard_dir or cfg.ckpt.save) else None)
    if plot_path:
        result["plot"] = lg.plot(plot_path)
        if result["plot"]:
            lg.print(f" loss plot: {result['plot']}")
    if cfg.log.sample_prompt is not None:  # every rank generates (TP shards), the logging rank prints
        from ..inference.sample import training_sample
        result["sample"] = training_sample(trainer.models[0].module, trainer.tokenizer, cfg)
        lg.print(f" sample: {cfg.log.sample_prompt + result['sample']!r}")
