"""``paratron generate`` and ``paratron serve``: sample from a checkpoint, or serve it over HTTP.

    paratron generate --load CKPT --prompt "def fib(" [--prompts-file F] [--json] [--max-new-tokens N]
                      [--temperature T] [--top-k K] [--top-p P] [--seed S] [--stop STR] [--logprobs]
    paratron serve --load CKPT [--host 127.0.0.1] [--port 5000] [--max-batch-size 32]

``--load`` is a paratron checkpoint directory (any parallel layout) or a Hugging Face model directory;
the tokenizer is the one saved with it. Under ``torchrun --nproc-per-node N`` the model is split over
N tensor-parallel ranks and rank 0 reads the prompts / serves (see docs/inference.md).
"""
from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import TYPE_CHECKING

from ..config import KernelConfig, inference
from ..config.help import field_help
from ..config.kernels import CHOICES
from ..config.sections import flag
from ..errors import ArgumentParser, ConfigError

if TYPE_CHECKING:
    from .sampling import SamplingParams


# the kernel switches a generation step reads (config/kernels.py); the others are training's
DECODE_SWITCHES = ("kernel_decode_attention", "kernel_decode_gemv", "kernel_decode_coordinate_descent",
                   "kernel_decode_pdl", "kernel_cublaslt")


def kernel_switches(args) -> KernelConfig:
    """The model's kernel switches: the generation ones as given (``auto`` where not), the rest ``auto``."""
    return KernelConfig(**{name: getattr(args, name) for name in DECODE_SWITCHES})


def switch_flags(kernels, asked_only: bool = False) -> list[str]:
    """The generation switches of ``kernels`` (a KernelConfig or the parsed flags) as "--flag value", or only those
    not ``auto``."""
    return [f"{flag(n)} {getattr(kernels, n)}" for n in DECODE_SWITCHES
            if not (asked_only and getattr(kernels, n) == "auto")]


def _common(p: ArgumentParser) -> None:
    p.add_argument("--load", required=True, metavar="DIR",
                   help="paratron checkpoint (training's --save directory) or Hugging Face model directory")
    p.add_argument("--iteration", type=int, help="this checkpoint iteration instead of the latest")
    p.add_argument("--device", help="cuda or cpu (default: cuda if there is one)")
    p.add_argument("--dtype", choices=("bf16", "fp16", "fp32"), help="weights and KV cache (default: as saved)")
    p.add_argument("--torch-compile", action="store_true",
                   help="compile the decode step with torch.compile (and replay it as a CUDA graph on GPUs)")
    p.add_argument("--tokenizer-model", metavar="PATH",
                   help="a tokenizer.json / HF directory, when the checkpoint has no tokenizer saved with it")
    p.add_argument("--expert-model-parallel-size", type=int, default=1, metavar="N",
                   help="under torchrun: split a mixture of experts' experts over N of the ranks (Megatron's flag; "
                        "attention stays split over all of them)")
    p.add_argument("--num-speculative-tokens", type=int, default=0, metavar="K",
                   help="speculative decoding (Megatron's flag): draft K tokens per step with the checkpoint's "
                        "multi-token prediction depths (--mtp-num-layers >= K) and verify them in one pass")
    for name in DECODE_SWITCHES:
        p.add_argument(flag(name), choices=CHOICES[name], default="auto", help=field_help(name))


def parse(p: ArgumentParser, argv: list[str]):
    """``p.parse_args(argv)``; a Megatron-LM flag the command does not take is named with the reason (the model,
    tokenizer and precision come from the checkpoint; the tensor-parallel size is the launch's process count)."""
    from ..config import FIELD_SECTION
    from ..config.megatron_flags import canonical, megatron_flags, refusal
    from ..config.megatron_reasons import RETIRED
    args, unknown = p.parse_known_args(argv)
    if not unknown:
        return args
    known, said = megatron_flags(), []
    for f in (u.split("=", 1)[0] for u in unknown if u.startswith("--")):
        name = canonical(f[2:].replace("-", "_"))
        if name in RETIRED:
            said.append(f"{f} is no longer a paratron flag: {RETIRED[name].removesuffix('; remove the flag')}")
        elif name == "tensor_model_parallel_size":
            said.append(f"{f}: {p.prog} splits the model over every process torchrun starts (--nproc-per-node)")
        elif name in FIELD_SECTION:
            said.append(f"{f} is a training flag: {p.prog} reads the model, its tokenizer and precision from the "
                        "checkpoint under --load")
        elif name in known:
            why = (refusal(name) or "a training flag").removesuffix("; remove the flag")
            said.append(f"{f} (Megatron-LM's) is not a {p.prog} flag: {why}")
    if not said:
        p.error(f"unrecognized arguments: {' '.join(unknown)}")
    p.error("; ".join(said) + ("; remove them" if len(said) > 1 else "; remove it"))


def generate_parser() -> ArgumentParser:
    p = ArgumentParser(prog="paratron generate", description="Continue prompts with a trained model.")
    _common(p)
    p.add_argument("--prompt", action="append", default=[], help="a prompt (repeat for several)")
    p.add_argument("--prompts-file", metavar="FILE",
                   help="one prompt per line; a .jsonl file: one JSON string or {\"prompt\": ...} per line")
    p.add_argument("--json", action="store_true", help="print one JSON object per prompt instead of text")
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--temperature", type=float, default=0.0, help="0 (default) is greedy")
    p.add_argument("--top-k", type=int, default=0, help="sample among the K most likely (0: all)")
    p.add_argument("--top-p", type=float, default=1.0, help="sample among the smallest set of probability P")
    p.add_argument("--seed", type=int, help="seed of the sampling (reproducible output)")
    p.add_argument("--stop", action="append", default=[], help="stop when the text contains this (repeatable)")
    p.add_argument("--ignore-eod", action="store_true", help="do not stop at the end-of-document token")
    p.add_argument("--logprobs", action="store_true", help="with --json: log-probabilities of every token")
    p.add_argument("--add-bos", action="store_true", help="prepend the end-of-document token (Megatron's add_BOS)")
    p.add_argument("--batch-size", type=int, default=None,
                   help="prompts generated together by the fixed-batch engine (default 32; the paged engine takes "
                        "every prompt at once and runs --inference-dynamic-batching-max-requests of them)")
    from ..config import inference
    inference.add_arguments(p, serve=False)
    return p


def read_prompts(args) -> list[str]:
    prompts = list(args.prompt)
    if args.prompts_file:
        path = Path(args.prompts_file)
        if not path.is_file():
            raise ConfigError(f"--prompts-file {path}: no such file")
        for n, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
            if not line.strip():
                continue
            if path.suffix == ".jsonl":
                try:
                    value = json.loads(line)
                except ValueError:
                    raise ConfigError(f"--prompts-file {path}:{n}: not JSON") from None
                value = value.get("prompt") if isinstance(value, dict) else value
                if not isinstance(value, str):
                    raise ConfigError(f"--prompts-file {path}:{n}: expected a string or {{\"prompt\": string}}")
                prompts.append(value)
            else:
                prompts.append(line)
    if not prompts:
        raise ConfigError("no prompt: pass --prompt TEXT or --prompts-file FILE")
    return prompts


def open_model(args):
    """(TextModel, dims) of ``--load`` on this rank; the caller closes the group."""
    from .engine import Engine
    from .load import load_for_inference
    from .runtime import Group, start
    from .text import TextModel, chat_template
    dims, device = start(args.device, args.expert_model_parallel_size)
    kernels = kernel_switches(args)
    loaded = load_for_inference(args.load, dims, device, args.dtype, args.iteration, kernels)
    if loaded.model.config.model == "bert":
        raise ConfigError(f"--load {args.load} holds a BERT: it fills masks (paratron fill-mask), it does not "
                          "generate text")
    tok = loaded.tokenizer
    if args.tokenizer_model:
        tok = _tokenizer(args.tokenizer_model)
    if tok is None:
        raise ConfigError(f"--load {args.load}: no tokenizer saved with it; pass --tokenizer-model PATH")
    try:
        engine = Engine(loaded.model, loaded.vocab_size, tok.eod, tok.detokenize, compile=args.torch_compile,
                        num_speculative_tokens=args.num_speculative_tokens)
    except ValueError as e:
        raise ConfigError(str(e)) from None
    if dims.rank == 0:
        print(" kernel switches: " + ", ".join(switch_flags(kernels)), file=sys.stderr, flush=True)
    if args.num_speculative_tokens and dims.rank == 0:
        print(f"speculative decoding: --num-speculative-tokens {args.num_speculative_tokens} (drafts from the "
              f"model's multi-token prediction depths 1..{args.num_speculative_tokens})", file=sys.stderr, flush=True)
    return TextModel(Group(engine, dims), tok, loaded.name, chat_template(args.load)), dims


def _tokenizer(path: str):
    """--tokenizer-model: a directory with tokenizer files, or a tokenizer.json."""
    from ..checkpoint.tokenizer_files import load_tokenizer
    from ..config import DataConfig
    from ..data.tokenizers import build_tokenizer
    if Path(path).is_dir():
        tok = load_tokenizer(path)
        if tok is None:
            raise ConfigError(f"--tokenizer-model {path}: no tokenizer.json, vocab.json + merges.txt or tokenizer.model there")
        return tok
    return build_tokenizer(DataConfig(tokenizer_type="HuggingFaceTokenizer", tokenizer_model=path))


def params_from(args) -> SamplingParams:
    from .sampling import SamplingParams  # (torch: not imported for --help)
    params = SamplingParams(args.max_new_tokens, args.temperature, args.top_k, args.top_p, args.seed,
                            tuple(args.stop), args.ignore_eod, args.logprobs)
    problem = params.check()
    if problem:
        name, why = problem.split(":", 1)
        raise ConfigError(f"--{name.replace('_', '-')}:{why}")
    return params


def generate_main(argv: list[str]) -> int:
    from ..config import inference
    args = parse(generate_parser(), argv)
    params = params_from(args)
    limits = inference.from_args(args)
    if limits.inference_dynamic_batching:
        if args.batch_size is not None:
            raise ConfigError("--batch-size is the fixed-batch engine's; with --inference-dynamic-batching every "
                              "prompt goes to the paged engine at once (--inference-dynamic-batching-max-requests "
                              "run together)")
    batch = 32 if args.batch_size is None else args.batch_size
    if batch < 1:
        raise ConfigError("--batch-size must be >= 1")
    from .load import is_t5
    if is_t5(args.load):  # encoder-decoder generation (one process)
        if limits.inference_dynamic_batching:
            raise ConfigError("--inference-dynamic-batching: T5 generates on the fixed-batch engine (no paged "
                              "encoder-decoder cache)")
        asked = switch_flags(args, asked_only=True)
        if asked:
            raise ConfigError(f"{', '.join(asked)}: T5 generates through its own decoder loop, which takes no kernel "
                              "switches; leave them at auto")
        from .t5_generate import generate_main as t5_main
        return t5_main(args, params)
    if limits.inference_dynamic_batching:
        return on_ranks(args, lambda model: generate_paged(model, args, params, limits))

    def lead(model) -> None:
        from .speculative import Acceptance
        prompts = read_prompts(args)
        total = None
        for start in range(0, len(prompts), batch):
            chunk = prompts[start:start + batch]
            reqs = model.requests(chunk, params, args.add_bos, first=start)
            problem = model.check(reqs)
            if problem:
                raise ConfigError(problem)
            for text, res in zip(chunk, model.run(reqs)):
                _print(text, res, args.json)
            if model.engine.acceptance is not None:  # speculative decoding's counts of this batch
                total = total or Acceptance()
                total.add(model.engine.acceptance)
        if total is not None:
            print(speculative_summary(total), file=sys.stderr, flush=True)
    return on_ranks(args, lead)


def generate_paged(model, args, params, limits) -> None:
    """``paratron generate --inference-dynamic-batching``: every prompt into the paged engine at once (requests
    join and leave between steps), the answers printed in the prompts' order."""
    engine = model.group.paged(limits)
    prompts = read_prompts(args)
    reqs = model.requests(prompts, params, args.add_bos)
    problem = model.check(reqs) or next((p for p in map(engine.check, reqs) if p), None)
    if problem:
        raise ConfigError(problem)
    print(engine.startup_line(), file=sys.stderr, flush=True)
    for text, res in zip(prompts, engine.generate(reqs)):
        _print(text, res, args.json)
    if getattr(engine, "acceptance", None) is not None:  # the speculative paged engine's counts (paged_spec.py)
        print(speculative_summary(engine.acceptance), file=sys.stderr, flush=True)


def speculative_summary(s) -> str:
    """Speculative decoding's acceptance (speculative.Acceptance), one line."""
    return (f"speculative decoding: {s.accepted} of {s.drafted} drafted tokens accepted (rate {s.rate:.3f}), "
            f"{s.tokens_per_step:.2f} tokens per row and verification pass" if s.steps else
            "speculative decoding: no verification pass ran")


def on_ranks(args, lead) -> int:
    """Open --load on every rank; rank 0 runs ``lead(model)`` while the others follow its batches."""
    model, dims = open_model(args)
    try:
        if dims.rank == 0:
            lead(model)
        else:
            model.group.follow()
    finally:
        model.group.close()
    return 0


def _print(prompt: str, res, as_json: bool) -> None:
    if as_json:
        out = {"prompt": prompt, "text": res.text, "tokens": res.tokens, "finish_reason": res.finish_reason}
        if res.logprobs is not None:
            out.update(logprobs=res.logprobs, prompt_logprobs=res.prompt_logprobs)
        print(json.dumps(out), flush=True)
    else:
        print(prompt + res.text, flush=True)


def serve_main(argv: list[str]) -> int:
    p = ArgumentParser(prog="paratron serve", description="Serve a model over HTTP (Megatron's PUT /api, "
                       "OpenAI's /v1/completions and /v1/chat/completions).")
    _common(p)
    p.add_argument("--host", default="127.0.0.1", help="address to listen on (default %(default)s)")
    p.add_argument("--port", type=int, default=5000)
    p.add_argument("--max-batch-size", type=int, default=32, help="requests generated together at most")
    p.add_argument("--batch-wait-ms", type=float, default=5.0,
                   help="how long the first waiting request waits for others to join its batch")
    p.add_argument("--model-name", help="the model's name in the API (default: the --load directory's name)")
    p.add_argument("--continuous-batching", action="store_true",
                   help="requests join a running batch between decode steps instead of waiting for it to end "
                        "(one process: tensor parallelism is not supported with it)")
    inference.add_arguments(p)
    args = parse(p, argv)
    if args.max_batch_size < 1:
        raise ConfigError("--max-batch-size must be >= 1")
    limits = inference.from_args(args)
    if args.continuous_batching and limits.inference_dynamic_batching:
        raise ConfigError("--continuous-batching and --inference-dynamic-batching are two engines: choose one")

    def run(model) -> None:
        from .server import serve
        if args.continuous_batching and args.num_speculative_tokens:
            raise ConfigError("--num-speculative-tokens runs on the fixed-batch and the paged engines; serve without "
                              "--continuous-batching")
        if args.continuous_batching and model.group.dims.tp > 1:
            raise ConfigError("--continuous-batching runs on one process; under tensor parallelism serve with "
                              "--inference-dynamic-batching (the paged engine) or the fixed-batch engine")
        print("\n".join(inference.startup_lines(limits)), flush=True)
        serve(model, args.host, args.port, args.max_batch_size, args.batch_wait_ms / 1000.0,
              args.model_name or model.name, args.continuous_batching, limits)
    return on_ranks(args, run)

