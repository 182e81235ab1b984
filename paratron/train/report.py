"""What a training run prints and writes once it is over: the loss plot and, with --sample-prompt, the
trained model's continuation of the prompt."""
from __future__ import annotations

from pathlib import Path

from ..errors import ConfigError


def check_sample_prompt(cfg, tokenizer) -> None:
    """Tokenize --sample-prompt at start-up, so that a prompt the tokenizer cannot read is one line before
    step 1, not a traceback after the whole run (NullTokenizer reads only token ids: ``--sample-prompt "1 2 3"``)."""
    if cfg.log.sample_prompt is None:
        return
    try:
        tokenizer.tokenize(cfg.log.sample_prompt)
    except (ValueError, KeyError, TypeError, UnicodeError) as e:
        hint = (" (NullTokenizer reads token ids separated by spaces, e.g. --sample-prompt \"1 2 3\")"
                if type(tokenizer).__name__ == "NullTokenizer" else "")
        raise ConfigError(f"--sample-prompt {cfg.log.sample_prompt!r} cannot be tokenized by --tokenizer-type "
                          f"{cfg.data.tokenizer_type}: {e}{hint}") from None


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
