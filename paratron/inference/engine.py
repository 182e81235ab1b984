"""Batched generation with a KV cache: prefill the prompts, then one decode step per new token.

The prompts of a batch are left-padded to the longest (positions and masks account for the
padding: see cache.py), the prompt runs once through the model filling the cache, and every decode
step feeds one token per row at the same cache slot. The decode step has static shapes (the batch,
the cache capacity; the slot is a tensor), so ``compile=True`` compiles it with ``torch.compile``
and, on CUDA, replays it as a CUDA graph (graphs.py).

At TP > 1 every rank of the tensor-parallel group runs the same calls (``Engine.generate`` with the
same requests: serve.py's follower loop does it); the logits are gathered over TP and the sampled
tokens broadcast from TP rank 0, so all ranks carry the same tokens.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Optional

import torch
import torch.distributed as dist

from ..config.kernels import decode_rows, pdl_at
from ..errors import ConfigError
from ..kernels import gemv_row
from ..model.layers import ForwardContext, Norm
from ..parallel import comm
from .cache import CacheView, KVCache, RowView
from .sampling import Sampler, SamplingParams, find_stop

CACHE_ROUND = 64  # cache capacity is rounded up to this (with compile=True: to a power of two, at least this)
SYNC_EVERY = 16  # decode steps between reads of the tokens by the host (when nothing needs each one at once)


@dataclass
class Request:
    prompt: list  # token ids
    params: SamplingParams = field(default_factory=SamplingParams)


@dataclass
class Result:
    prompt: list
    tokens: list  # generated token ids (the end-of-document token not included)
    finish_reason: str  # "stop" (EOD or a stop string) or "length"
    text: Optional[str] = None  # decoded, cut before a stop string (when the engine has a detokenizer)
    logprobs: Optional[list] = None  # of each generated token
    prompt_logprobs: Optional[list] = None  # of each prompt token (None for the first)
    top_logprobs: Optional[list] = None  # per generated token: [(token id, log-probability)] most likely first


def context_length(cfg) -> int:
    """The most tokens (prompt + generated) the model can take."""
    if cfg.position_embedding_type == "learned_absolute":
        return cfg.max_position_embeddings
    return max(cfg.max_position_embeddings or 0, cfg.seq_length)


def decode_gemv(switch: str, device) -> str:
    """How decode steps run their linear layers (``Engine.gemv_at``), by ``--kernel-decode-gemv``: triton (the GEMV
    kernels at 1..8 rows, kernels/gemv.py), auto (on CUDA the row kernels at one row, kernels/gemv_row.py; torch
    elsewhere), torch; triton is refused off CUDA."""
    cuda = torch.device(device).type == "cuda"
    if switch == "triton" and not cuda:
        raise ConfigError("--kernel-decode-gemv triton: the GEMV kernel needs a CUDA device (choose torch or auto)")
    return switch if cuda or switch != "auto" else "torch"


class Engine:
    """Generation from ``model`` (a GPTModel, one pipeline stage, any TP) over token ids.

    ``vocab_size``: the real vocabulary (logits of padded rows are never chosen); ``eod``: the
    end-of-document token; ``detokenize``: ids -> text, for stop strings and ``Result.text``."""

    def __init__(self, model, vocab_size: int, eod: Optional[int] = None,
                 detokenize: Optional[Callable[[list], str]] = None, compile: bool = False,
                 num_speculative_tokens: int = 0):
        """``num_speculative_tokens`` k > 0: speculative decoding, k tokens drafted per step by the model's own
        multi-token prediction depths and verified in one pass (speculative.py)."""
        if not (model.pre_process and model.post_process):
            raise ValueError("generation needs the whole model on each rank (pipeline parallelism is not supported)")
        if num_speculative_tokens:
            from .speculative import check_speculative
            check_speculative(model, num_speculative_tokens)
        self.model = model.eval()
        self.vocab_size, self.eod, self.detokenize = vocab_size, eod, detokenize
        self.device = next(model.parameters()).device
        self.context = context_length(model.config)
        self.tp_group = model.par.tp_group
        self.tp_src = dist.get_global_rank(self.tp_group, 0) if model.par.tp_size > 1 else 0
        self.compile = compile
        self.gemv = decode_gemv(model.kernels.kernel_decode_gemv, self.device)  # decode steps' linear layers (gemv_at)
        norm = getattr(model.decoder, "final_layernorm", None)
        # a one-row step under the GEMV kernels: the final RMSNorm in the output layer's row GEMV (kernels/gemv_row.py)
        self.row_head = (isinstance(norm, Norm) and norm.plain_rms and model.output_mult == 1.0
                         and model.par.tp_size == 1)
        self.row_layers = any(getattr(layer, "decode_rows", False) for layer in model.modules())
        self.num_speculative_tokens = num_speculative_tokens
        self.acceptance = None  # speculative decoding's counts of the last generate (speculative.Acceptance)
        self.speculative_steps = None  # speculative decoding's fixed-shape passes for the cache (speculative.Steps)
        self.cache: Optional[KVCache] = None
        self.graph = None
        self._argmax = None  # (logits, their version, argmax) of the compiled decode step's last call
        self.peak_cache_bytes = 0  # the largest KV cache allocated so far (the server's /health reports it)

    # ---- the model passes ---------------------------------------------------------------
    def _forward(self, ids: torch.Tensor, positions: torch.Tensor, view, mask: Optional[torch.Tensor],
                 last_only: bool = False, pick: Optional[torch.Tensor] = None, gemv: bool = False) -> torch.Tensor:
        """Logits [b, s (1 if last_only, len(pick) if given), vocab] of ``ids`` [b, s], writing their keys/values
        to the cache (``view``: a CacheView, or the paged engine's PagedView); ``pick``: the positions whose
        logits are wanted; ``gemv``: a decode step's linear layers through kernels/gemv.py (``self.gemv``)."""
        if gemv and ids.numel() == 1 and self.row_head:  # the final norm and the output layer: one row GEMV
            x = self.hidden(ids, positions, view, mask, gemv, normed=False)
            norm = self.model.decoder.final_layernorm
            out = gemv_row.linear(x, self.model.output_weight(), norm.weight, eps=norm.eps,
                                  pdl=pdl_at(self.decode_pdl(), 1))
            return out.transpose(0, 1)[..., :self.vocab_size]
        x = self.hidden(ids, positions, view, mask, gemv)
        if last_only:
            x = x[-1:]
        elif pick is not None:
            x = x.index_select(0, pick)
        return self.logits(x, gemv)

    def hidden(self, ids: torch.Tensor, positions: torch.Tensor, view, mask: Optional[torch.Tensor],
               gemv: bool = False, normed: bool = True) -> torch.Tensor:
        """The decoder's output [s, b, h] (after its final norm, unless not ``normed``) of ``ids`` [b, s], writing the
        cache."""
        m = self.model
        rope = m.rotary(ids.shape[1], positions) if m.rotary is not None else None
        ctx = ForwardContext(rope=rope, mask=mask, causal=False, kv_cache=view, gemv=gemv,
                             gemv_rows_only=self.gemv == "auto")
        return m.decoder(m.embedding(ids, positions), ctx, final_norm=normed)

    def logits(self, x: torch.Tensor, gemv: bool = False) -> torch.Tensor:
        """Logits [b, s, vocab] (the real vocabulary, gathered over TP) of hidden states ``x`` [s, b, h]."""
        m = self.model
        head = m.head_input(x)
        out = m.output_layer(head, m.output_weight(), gemv=True) if gemv else m.output_layer(head, m.output_weight())
        logits = comm.gather_from_tp(out, self.tp_group)
        return logits.transpose(0, 1)[..., :self.vocab_size]

    def decode_step(self, tokens: torch.Tensor, slot: torch.Tensor) -> torch.Tensor:
        """Logits [b, vocab] after ``tokens`` [b, 1] written at cache slot ``slot`` (0-d tensor): fixed shapes."""
        cache = self.cache
        positions = (slot - cache.pad)[:, None].clamp(min=0)
        view = CacheView(cache, slot.view(1), cache.capacity)
        return self._forward(tokens, positions, view, cache.decode_mask(slot), gemv=self.gemv_at(tokens.size(0)))[:, 0]

    def gemv_at(self, rows: int) -> bool:
        """Whether a decode step of ``rows`` rows runs its linear layers through the GEMV kernels (``self.gemv``; auto:
        in a model with layers that run as row GEMVs, measured on such models only)."""
        return decode_rows(self.gemv, rows) and (self.gemv != "auto" or self.row_layers)

    def decode_pdl(self) -> str:
        """``--kernel-decode-pdl`` for the compiled decode step: auto launches early only where the layers run as
        row GEMVs (Inductor's kernels alone measured slower launched early)."""
        pdl = self.model.kernels.kernel_decode_pdl
        return "off" if pdl == "auto" and (self.gemv == "torch" or not self.row_layers) else pdl

    def prefill(self, ids: torch.Tensor, need_all: bool) -> torch.Tensor:
        """Logits of the left-padded prompts ``ids`` [b, L]: every position's if ``need_all``, else the last."""
        slots = torch.arange(ids.shape[1], device=self.device)
        view = CacheView(self.cache, slots, ids.shape[1])
        return self._forward(ids, self.cache.positions(slots), view, self.cache.prefill_mask(ids.shape[1]),
                             last_only=not need_all)

    def prefill_row(self, row: int, prompt: list, at: int, need_all: bool) -> torch.Tensor:
        """Logits [L or 1, vocab] of ``prompt`` (L tokens) written into cache row ``row`` at slots
        at - L .. at - 1 (the row's padding is set to at - L): a prompt joining a running batch."""
        n = len(prompt)
        slots = torch.arange(at - n, at, device=self.device)
        self.cache.pad[row] = at - n
        keys = torch.arange(at, device=self.device)
        mask = ((keys[None, :] >= at - n) & (keys[None, :] <= slots[:, None]))[None, None]
        ids = torch.tensor([prompt], device=self.device)
        positions = torch.arange(n, device=self.device)[None]
        return self._forward(ids, positions, RowView(self.cache, row, slots, at), mask, last_only=not need_all)[0]

    def _prepare_cache(self, batch: int, capacity: int) -> None:
        if self.cache is None or self.cache.batch != batch or self.cache.capacity != capacity:
            self.cache, self.graph, self.speculative_steps = None, None, None  # free the old ones first
            dtype = next(self.model.parameters()).dtype
            self.cache = KVCache(self.model, batch, capacity, device=self.device, dtype=dtype,
                                 mtp_depths=self.num_speculative_tokens)
            self.peak_cache_bytes = max(self.peak_cache_bytes, sum(b.numel() * b.element_size()
                                                                   for b in self.cache.buffers()))
        if self.compile and self.graph is None:
            from .graphs import DecodeRunner, with_argmax
            k = self.model.kernels
            self.graph = DecodeRunner(with_argmax(self.decode_step), batch, self.device,
                                     k.kernel_decode_coordinate_descent, self.decode_pdl())

    def _step(self, tokens: torch.Tensor, slot: int) -> torch.Tensor:
        """The decode step's logits [b, vocab]; their argmax, where the compiled step computed it, is
        ``argmax_of(logits)``."""
        self._argmax = None
        if self.graph is not None:
            logits, best = self.graph(tokens, slot)
            self._argmax = (logits, logits._version, best)  # (a row written since, a request joining: not its argmax)
            return logits
        return self.decode_step(tokens, torch.tensor(slot, device=self.device))

    def argmax_of(self, logits: torch.Tensor) -> Optional[torch.Tensor]:
        """The argmax of ``logits`` [b, vocab] computed by the compiled decode step that returned them and unchanged
        since (a request joining a running batch writes its row), else None."""
        if self._argmax is None:
            return None
        returned, version, best = self._argmax
        return best if logits is returned and logits._version == version else None

    # ---- generation -------------------------------------------------------------------------
    def check(self, req: Request) -> Optional[str]:
        """Why ``req`` cannot be generated ('field: why'), or None."""
        if not req.prompt:
            return "prompt: is empty (give at least one token)"
        if len(req.prompt) >= self.context:
            return f"prompt: {len(req.prompt)} tokens, the model's context is {self.context} (prompt + new tokens)"
        bad = [t for t in req.prompt if not 0 <= int(t) < self.vocab_size]
        if bad:
            return f"prompt: token id {bad[0]} is outside the vocabulary [0, {self.vocab_size})"
        return req.params.check()

    @torch.no_grad()
    def generate(self, requests: list[Request], on_step: Optional[Callable[[list], None]] = None) -> list[Result]:
        """Continue every request's prompt (one batch). ``on_step(new)``: called after each step with
        the token id each row got (None for a row already finished)."""
        for r in requests:
            problem = self.check(r)
            if problem:
                raise ValueError(problem)
        real = len(requests)
        if not real:
            return []
        if self.compile:  # batch sizes in powers of two: fewer shapes to compile and capture
            requests = requests + [Request([0], SamplingParams(max_new_tokens=0))] * ((1 << (real - 1).bit_length()) - real)
        if self.num_speculative_tokens:
            from .speculative import SpeculativeRun
            run = SpeculativeRun(self, requests)
        else:
            run = _Run(self, requests)
        run.prefill()
        run.decode(None if on_step is None else lambda new: on_step(new[:real]))
        return run.results()[:real]

    def _broadcast(self, tokens: torch.Tensor) -> torch.Tensor:
        if self.model.par.tp_size > 1:
            dist.broadcast(tokens, self.tp_src, group=self.tp_group)
        return tokens


class _Run:
    """The state of one batch being generated."""

    def __init__(self, engine: Engine, requests: list[Request], headroom: int = 1):
        """``headroom``: the cache holds this many times what the requests need (more requests may join)."""
        self.e, self.requests = engine, list(requests)
        self.params = [r.params for r in requests]
        b, dev = len(requests), engine.device
        self.length = max(len(r.prompt) for r in requests)
        want = (self.length + max(p.max_new_tokens for p in self.params)) * headroom
        rounded = max(CACHE_ROUND, 1 << (want - 1).bit_length()) if engine.compile else -(-want // CACHE_ROUND) * CACHE_ROUND
        capacity = self.capacity = min(rounded, engine.context)
        # every row starts writing at the longest prompt's end: its tokens fit in the slots after it
        self.new_max = [min(p.max_new_tokens, capacity - self.length) for p in self.params]
        self.steps = max(self.new_max)
        engine._prepare_cache(b, capacity)
        pads = [self.length - len(r.prompt) for r in requests]
        engine.cache.pad.copy_(torch.tensor(pads, device=dev))
        self.ids = torch.tensor([[0] * p + list(r.prompt) for p, r in zip(pads, requests)], device=dev)
        self.sampler = Sampler(self.params, dev)
        self.want_logprobs = any(p.logprobs for p in self.params)
        self.tokens = [[] for _ in requests]
        self.logprobs = [[] for _ in requests]
        self.top = [[] for _ in requests]
        self.n_top = max(p.top_logprobs if p.logprobs else 0 for p in self.params)
        self.prompt_logprobs = [None] * b
        self.done = [m <= 0 for m in self.new_max]
        self.reason = ["length"] * b
        self.last: Optional[torch.Tensor] = None

    def prefill(self) -> None:
        self.took_prompt(self.e.prefill(self.ids, need_all=self.want_logprobs))

    def took_prompt(self, logits: torch.Tensor) -> None:
        """The prompt pass's logits [b, L or 1, vocab]: the prompt log-probabilities (rows that ask) and the last."""
        if self.want_logprobs:
            for i, r in enumerate(self.requests):
                if self.params[i].logprobs:
                    start = self.length - len(r.prompt)
                    self.prompt_logprobs_of(i, logits[i, start:], self.ids[i, start:])
        self.last = logits[:, -1]

    def decode(self, on_step) -> None:
        """One step per new token. The host reads the tokens back (a synchronisation) every step when
        something needs them at once (streaming, stop strings), else every SYNC_EVERY steps: in between
        the GPU runs ahead, and rows that finish early are known at the next read."""
        e = self.e
        every = 1 if on_step is not None or any(p.stop for p in self.params) else SYNC_EVERY
        pending = []
        for step in range(self.steps):
            best = e.argmax_of(self.last)
            tok = e._broadcast(self.sampler(self.last, best))
            # all-greedy rows take the decode graph's own argmax buffer, which its next replay overwrites: the
            # tokens kept until the next read are a copy
            pending.append(self._outputs(tok.clone() if every > 1 and tok is best else tok))
            final = step == self.steps - 1
            if len(pending) == every or final:
                self._flush(pending, on_step)
                pending = []
                if all(self.done):
                    return
            if not final:
                self.last = e._step(tok[:, None], self.length + step)

    def _outputs(self, tok: torch.Tensor) -> tuple:
        """(tokens, their log-probabilities, the top ones) of one step, left on the device."""
        lp = top = None
        if self.want_logprobs:
            full = torch.log_softmax(self.last.float(), dim=-1)
            lp = full.gather(-1, tok[:, None])[:, 0]
            if self.n_top:
                top = full.topk(min(self.n_top, full.shape[-1]), dim=-1)
        return tok, lp, top

    def _flush(self, pending: list, on_step) -> None:
        tokens = torch.stack([t for t, _, _ in pending]).tolist()
        for toks, (_, lp, top) in zip(tokens, pending):
            tops = None if top is None else [list(zip(i, v)) for i, v in zip(top.indices.tolist(), top.values.tolist())]
            new = self._record(toks, None if lp is None else lp.tolist(), tops)
            if on_step is not None:
                on_step(new)

    def _record(self, toks: list, lp: Optional[list], top: Optional[list]) -> list:
        """Append this step's tokens to the unfinished rows, finishing those that stop; the rows' new tokens."""
        new = [None] * len(toks)
        for i, t in enumerate(toks):
            if self.done[i]:
                continue
            p = self.params[i]
            if t == self.e.eod and not p.ignore_eod:
                self.done[i], self.reason[i] = True, "stop"
                continue
            self.tokens[i].append(t)
            new[i] = t
            if lp is not None and p.logprobs:
                self.logprobs[i].append(lp[i])
                if p.top_logprobs:
                    self.top[i].append(top[i][:p.top_logprobs])
            if p.stop and self.e.detokenize is not None and find_stop(self.e.detokenize(self.tokens[i]), p.stop) \
                    is not None:
                self.done[i], self.reason[i] = True, "stop"
            elif len(self.tokens[i]) >= self.new_max[i]:
                self.done[i] = True
        return new

    def result(self, i: int) -> Result:
        """Row ``i``'s result (its request as generated so far)."""
        text = None
        if self.e.detokenize is not None:
            text = self.e.detokenize(self.tokens[i])
            cut = find_stop(text, self.params[i].stop)
            text = text if cut is None else text[:cut]
        p = self.params[i]
        lp = self.logprobs[i] if p.logprobs else None
        top = self.top[i] if p.logprobs and p.top_logprobs else None
        return Result(list(self.requests[i].prompt), self.tokens[i], self.reason[i], text, lp, self.prompt_logprobs[i],
                      top)

    def results(self) -> list[Result]:
        return [self.result(i) for i in range(len(self.requests))]

    def prompt_logprobs_of(self, i: int, logits: torch.Tensor, ids: torch.Tensor) -> None:
        """Row ``i``'s prompt log-probabilities from ``logits`` [L, vocab] of its prompt ``ids`` [L]."""
        lp = torch.log_softmax(logits[:-1].float(), dim=-1)
        self.prompt_logprobs[i] = [None] + lp.gather(-1, ids[1:, None])[:, 0].tolist()

    def admit(self, i: int, req: Request, at: int) -> None:
        """``req`` joins the batch in row ``i`` (free: its request is done), its prompt ending at slot
        ``at``: prefilled into that row, its first token sampled at the next step with the others."""
        p = req.params
        self.requests[i], self.params[i] = req, p
        self.new_max[i] = min(p.max_new_tokens, self.capacity - at)
        self.tokens[i], self.logprobs[i], self.top[i], self.prompt_logprobs[i] = [], [], [], None
        self.done[i], self.reason[i] = self.new_max[i] <= 0, "length"
        self.sampler.set_row(i, p)
        self.want_logprobs |= p.logprobs
        self.n_top = max(self.n_top, p.top_logprobs if p.logprobs else 0)
        logits = self.e.prefill_row(i, list(req.prompt), at, need_all=p.logprobs)
        if p.logprobs:
            self.prompt_logprobs_of(i, logits, torch.tensor(req.prompt, device=logits.device))
        self.last[i] = logits[-1]
