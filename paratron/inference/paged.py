"""The paged engine (``--inference-dynamic-batching``): requests of any length run together over one pool of KV
blocks, joining and leaving between any two steps.

A step (:meth:`PagedEngine.step`) asks the scheduler (scheduler.py) which tokens to compute: one per decoding
request and chunks of prompts, within the token budget. They are packed into one sequence and run through the
model once: each attention layer writes their keys and values into their requests' blocks and attends through
the block tables (paged_cache.py, kernels/paged_attention.py). The logits of each request's last computed token
give its next token (its own sampling parameters and generator; stop conditions as the fixed-batch engine's).
A step of decodes only is replayed from a CUDA graph of its batch-size bucket on GPUs (paged_graphs.py); under
``--torch-compile`` the other steps run compiled, their sizes symbolic (``MixedStep``). A model
with Mamba-2 / Gated DeltaNet layers keeps a row of recurrent states per request: its decodes run in a pass of a
token per batch row, its prompt chunks packed into one more pass, a document each (``_run_recurrent``).

Greedy and seeded results equal each request generated alone (tests/unit/test_paged_engine.py). Under tensor
parallelism every rank holds its share of the KV heads and runs the same scheduler: the engine is built through
``runtime.Group.paged``, the pool's block count is the smallest any rank can hold, rank 0 sends the requests it
added with each step (the followers add them in the same order and step too: ``Group.follow``), and each step's
tokens are rank 0's (tests/parallel/test_paged_tp.py).
"""
from __future__ import annotations

import itertools
import time
from typing import Callable, Optional

import torch
import torch.distributed as dist

from ..errors import ConfigError
from ..kernels.paged_attention import tiles_of
from ..model.attention.windowed import needs_core_attention
from ..parallel.tensor import set_cublaslt
from .block_tables import BlockTables
from .blocks import BlockAllocator
from .engine import Engine, Request, Result
from .paged_cache import PagedKVCache, PagedView, PassStates, StateRows
from .sampling import Sampler, find_stop, on_device, row_generator
from .scheduler import Scheduler, Seq


def pool_blocks(engine: Engine, cfg, dtype: torch.dtype, reserved: int = 0, extra_layers: int = 0) -> int:
    """The pool's block count: --inference-dynamic-batching-num-blocks, else the buffer size in GB, else the
    memory fraction of the GPU's free memory less ``reserved`` bytes (a hybrid stack's state rows), else (CPU)
    enough for every request at the full context. A block's bytes count ``extra_layers`` more layers' pools (the
    MTP depths of speculative decoding, which use the same block tables)."""
    bs = cfg.inference_dynamic_batching_block_size
    per = PagedKVCache.block_bytes(engine.model, bs, dtype, extra_layers)
    if cfg.inference_dynamic_batching_num_blocks is not None:
        return cfg.inference_dynamic_batching_num_blocks
    if cfg.inference_dynamic_batching_buffer_size_gb is not None:
        return max(2, int(cfg.inference_dynamic_batching_buffer_size_gb * 2 ** 30 // per))
    if engine.device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(engine.device)
        room = free * cfg.inference_dynamic_batching_memory_fraction - reserved
        if reserved and room < 2 * per:
            raise ConfigError(f"the recurrent states of {cfg.inference_dynamic_batching_max_requests} requests "
                              f"({reserved / 2 ** 30:.2f} GB) leave no room for KV blocks: lower "
                              "--inference-dynamic-batching-max-requests")
        return max(2, int(room // per))
    return cfg.inference_dynamic_batching_max_requests * -(-engine.context // bs) + 1


def log_probs(logits: torch.Tensor, tokens: list, n_top: int) -> tuple[list, Optional[list]]:
    """(the log-probability of ``tokens[i]`` under row i of ``logits`` [n, vocab], each row's ``n_top`` most likely
    [(token, log-probability)] or None when ``n_top`` is 0)."""
    full = torch.log_softmax(logits.float(), dim=-1)
    lp = full.gather(-1, torch.tensor(tokens, device=full.device)[:, None])[:, 0].tolist()
    if not n_top:
        return lp, None
    values, indices = full.topk(min(n_top, full.size(-1)), dim=-1)
    return lp, [list(zip(i, v)) for i, v in zip(indices.tolist(), values.tolist())]


class PagedEngine:
    """Continuous batching over a paged KV cache for ``engine``'s model (an :class:`Engine`; under TP its rank's
    shard), as ``cfg`` (config/inference.py's InferenceConfig) says."""

    def __init__(self, engine: Engine, cfg, group=None):
        """``group``: the tensor-parallel ranks' runtime.Group (built by ``Group.paged`` under TP > 1)."""
        if engine.model.par.tp_size > 1 and group is None:
            raise ValueError("under tensor parallelism the paged engine is built on every rank by runtime.Group.paged")
        self.e, self.cfg = engine, cfg
        self.device = engine.device
        dtype = next(engine.model.parameters()).dtype
        self.block_size = cfg.inference_dynamic_batching_block_size
        self.group = group if engine.model.par.tp_size > 1 else None
        self.pending: list[Request] = []  # rank 0 under TP: the requests added since the last step
        recurrent = PagedKVCache.recurrent(engine.model)
        if recurrent and cfg.inference_dynamic_batching_prefix_caching:
            raise ConfigError("prefix caching shares attention blocks, and a Mamba-2 / Gated DeltaNet layer keeps no "
                              "state per block: serve this model without --inference-dynamic-batching-prefix-caching")
        rows = cfg.inference_dynamic_batching_max_requests if recurrent else 0
        self.state_bytes = PagedKVCache.state_bytes(engine.model, rows, dtype)
        depths = self.extra_pool_layers(engine)
        self.num_blocks = self._agreed(pool_blocks(engine, cfg, dtype, self.state_bytes, depths))
        self.cache = PagedKVCache(engine.model, self.num_blocks, self.block_size, self.device, dtype, rows)
        self.states = StateRows(rows) if recurrent else None
        self.block_bytes = PagedKVCache.block_bytes(engine.model, self.block_size, dtype, depths)
        self.blocks = BlockAllocator(self.num_blocks, self.block_size, cfg.inference_dynamic_batching_prefix_caching,
                                     cfg.inference_dynamic_batching_prefix_caching_eviction_policy)
        self.sched = Scheduler(self.blocks, cfg.inference_dynamic_batching_max_requests,
                               cfg.inference_dynamic_batching_max_tokens, cfg.enable_chunked_prefill)
        self.tables = BlockTables(cfg.inference_dynamic_batching_max_requests, -(-engine.context // self.block_size),
                                  self.device, self._tensor, lambda: self.sched.running)
        self.kernel = engine.model.kernels.kernel_decode_attention != "sdpa"
        # --kernel-cublaslt auto: torch's GEMM calls here. cuBLASLt's choice of algorithm is timed at a shape's first
        # and RETUNE_AT-th call (kernels/cublaslt.py), and a step carrying prompt chunks has a new row count nearly
        # every time: each such step would time its GEMMs (and wait for the timings) inside the step.
        self.cublaslt = engine.model.kernels.kernel_cublaslt == "on"
        set_cublaslt(engine.model, self.cublaslt)
        self.q_per_group = engine.model.config.num_attention_heads // engine.model.config.num_query_groups
        self.ids = itertools.count()
        self.reset_stats()
        self.graphs = None
        # (not taken under TP, whose graphs would capture the collectives too, for multi-latent attention or for
        # windows / sinks: none of them has run on a GPU yet)
        m = engine.model.config
        self.graphed = (self.group is None and not m.multi_latent_attention and not needs_core_attention(m)
                        and self.states is None)
        if self.device.type == "cuda" and cfg.inference_dynamic_batching_num_cuda_graphs > 0 and self.graphed:
            from .paged_graphs import DecodeGraphs
            self.graphs = DecodeGraphs(self, cfg.inference_dynamic_batching_num_cuda_graphs)
        self.mixed = None  # --torch-compile: the other steps compiled with symbolic sizes (paged_graphs.py)
        if engine.compile and self.graphed:
            from .paged_graphs import MixedStep
            self.mixed = MixedStep(self)

    @torch.no_grad()
    def warm_up(self) -> None:
        """Compile the steps and capture every decode step's CUDA graph now (the server does it at start-up), not
        at the first requests that need them. Nothing to do without --torch-compile or graphs."""
        if self.mixed is not None:
            self.mixed.warm_up()
        if self.graphs is not None:
            self.graphs.warm_up()

    @staticmethod
    def extra_pool_layers(engine: Engine) -> int:
        """Pools of one layer's shape that share the main pool's block tables (none; the speculative engine's MTP
        depths), counted when the pool is sized."""
        return 0

    def _agreed(self, blocks: int) -> int:
        """The pool's block count every TP rank can hold (their free memory differs): the same scheduling."""
        if self.group is None:
            return blocks
        t = torch.tensor([blocks], device=self.device)
        dist.all_reduce(t, op=dist.ReduceOp.MIN, group=self.e.tp_group)
        return int(t.item())

    # ---- requests ---------------------------------------------------------------------------
    def check(self, req: Request) -> Optional[str]:
        """Why ``req`` cannot run here ('field: why'), or None."""
        problem = self.e.check(req)
        if problem:
            return problem
        n = len(req.prompt)
        if n > self.cfg.inference_dynamic_batching_max_tokens and not self.cfg.enable_chunked_prefill:
            return (f"prompt: {n} tokens, more than a step's {self.cfg.inference_dynamic_batching_max_tokens} "
                    "(--inference-dynamic-batching-max-tokens; or serve with --enable-chunked-prefill)")
        kept = n + min(req.params.max_new_tokens, self.e.context - n) - 1
        need = -(-kept // self.block_size)
        if need > self.num_blocks - 1:
            return (f"prompt: prompt + max_tokens need {need} KV blocks, the pool holds {self.num_blocks - 1} "
                    "(raise --inference-dynamic-batching-buffer-size-gb / -num-blocks)")
        return None

    def add(self, req: Request, owner=None) -> Seq:
        """Queue ``req`` (checked by the caller); ``owner``: whatever the caller wants back with it."""
        p = req.params
        if self.group is not None and self.group.leader:
            self.pending.append(req)
        seq = Seq(next(self.ids), req, min(p.max_new_tokens, self.e.context - len(req.prompt)),
                  tokens=list(req.prompt), generator=row_generator(p, self.device), owner=owner)
        if seq.new_max <= 0 and not p.logprobs:
            seq.done = True
        else:
            self.sched.add(seq)
        return seq

    @property
    def idle(self) -> bool:
        return self.sched.idle

    def abort(self) -> None:
        """Drop every waiting and running request (after a failed step), releasing their blocks."""
        if self.group is not None and self.group.leader:
            self.pending = []
            self.group.send(("abort", None))
        for seq in list(self.sched.running):
            self.sched.finish(seq)
        self.sched.waiting.clear()
        self.tables.clear()
        if self.states is not None:
            self.states.clear()

    def generate(self, requests: list[Request], on_token: Optional[Callable] = None) -> list[Result]:
        """Every request at once, stepped until all are done (offline use and tests)."""
        for r in requests:
            problem = self.check(r)
            if problem:
                raise ValueError(problem)
        seqs = [self.add(r) for r in requests]
        while not self.idle:
            self.step(on_token)
        return [self.result(s) for s in seqs]

    # ---- one step ---------------------------------------------------------------------------
    @torch.no_grad()
    def step(self, on_token: Optional[Callable] = None) -> list[Seq]:
        """Schedule and run one step; the requests that finished in it. ``on_token(seq, token)``: each token
        generated (None: the request ended without a new token)."""
        if self.group is not None and self.group.leader:
            self.group.send(("step", self.pending))  # the followers add these and step with rank 0
            self.pending = []
        plan = self.sched.schedule()
        if not plan:
            if not self.idle:  # (the checks of ``check`` keep every request schedulable: a bug if not)
                raise RuntimeError(f"the paged engine cannot schedule its {len(self.sched.waiting)} waiting requests")
            return []
        self.steps += 1
        start = time.perf_counter()
        finished = self._advance(plan, on_token)
        for s in finished:
            self._release(s)
            if on_token is not None and s.new_max <= 0:
                on_token(s, None)
        self._timed(plan, start)
        return finished

    def _timed(self, plan: list, start: float) -> None:
        """A step of ``plan`` that began at ``start`` (perf_counter) into the step times /health reports."""
        took = time.perf_counter() - start
        waited, self.wait_mark = self.wait_s - self.wait_mark, self.wait_s
        self.step_s += took
        if plan and all(n == 1 for _, n in plan):
            self.decode_steps += 1
            self.decode_s += took
        else:  # a step with prompt chunks: how much of it was the host waiting for the device's tokens
            self.mixed_wait_s += waited

    def reset_stats(self) -> None:
        """Count steps and their times from now (a benchmark's timed run after its warm-up): steps (of which
        decodes only), their time and the time spent waiting for the device's tokens; the pool's peak (from the
        blocks held now) and the prefix-cache hits too, else a warm-up's would stand for the timed run's."""
        self.steps = self.decode_steps = 0
        self.step_s = self.wait_s = self.decode_s = self.mixed_wait_s = self.wait_mark = 0.0
        self.blocks.peak = self.blocks.used
        self.sched.prefix_hits = 0

    def _advance(self, plan: list, on_token) -> list[Seq]:
        """The model over the scheduled ``plan``: its tokens computed, the next ones chosen; the requests that
        finished."""
        logits, picks = self._run(plan)
        for seq, n in plan:
            seq.computed += n
            self.sched.register_full(seq)
        return self._next_tokens(plan, logits, picks, on_token)

    def _release(self, s: Seq) -> None:
        """What a finished request held: its blocks and its state row."""
        self.sched.finish(s)
        self.tables.release(s)
        if self.states is not None:
            self.states.release(s)

    def _pack(self, plan: list) -> tuple:
        """The step's tokens packed into one sequence: (ids, positions, slots, table rows, lengths, the positions
        whose logits are wanted, {seq id: their rows among those})."""
        bs, ids, pos, slots, rows, lengths, pick, picks = self.block_size, [], [], [], [], [], [], {}
        for r, (seq, n) in enumerate(plan):
            at = range(seq.computed, seq.computed + n)
            base = len(ids)
            ids += seq.tokens[seq.computed:seq.computed + n]
            pos += at
            slots += [seq.blocks[q // bs] * bs + q % bs for q in at]
            rows += [r] * n
            lengths += [q + 1 for q in at]
            every = seq.params.logprobs and seq.prompt_logprobs is None
            mine = list(range(base, base + n)) if every else [base + n - 1]
            picks[seq.id] = list(range(len(pick), len(pick) + len(mine)))
            pick += mine
        return ids, pos, slots, rows, lengths, pick, picks

    def _run(self, plan: list, patch: Optional[Callable] = None) -> tuple[torch.Tensor, dict]:
        """The model over the step's packed tokens: logits of the picked positions, {seq id: their rows}.
        ``patch(ids)``: fills the packed ids [tokens] on the device before the pass (paged_async.py)."""
        if self.states is not None:
            return self._run_recurrent(plan)
        ids, pos, slots, rows, lengths, pick, picks = self._pack(plan)
        if self.graphs is not None and all(n == 1 for _, n in plan) and len(pick) == len(plan):
            out = self.graphs(ids, pos, slots, self.tables.rows_for([seq for seq, _ in plan]), lengths, patch)
            if out is not None:
                return out, picks
        return self._forward(plan, ids, pos, slots, rows, lengths, pick, patch=patch), picks

    def _tensor(self, x) -> torch.Tensor:
        """``x`` on the engine's device, without waiting for the work queued there (``sampling.on_device``)."""
        return on_device(x, self.device)

    def _view(self, plan, slots, rows, lengths, state=None) -> PagedView:
        """The cache as the pass of ``plan``'s tokens sees it (``state``: PagedView's)."""
        at = self.tables.rows_for([seq for seq, _ in plan])
        t = self._tensor
        return PagedView(self.cache, t(slots), self.tables.table, t([at[r] for r in rows]), t(lengths), self.kernel,
                         state, self._tiles(plan))

    def _tiles(self, plan: list, extra: int = 0) -> Optional[torch.Tensor]:
        """The tiles of a pass with prompt chunks (None for decodes only, a token per row: the kernel's plain
        form); ``extra`` more single-token tiles after them (MixedStep's padding token)."""
        if not any(n > 1 for _, n in plan) and not extra:
            return None
        return self._tensor(tiles_of([n for _, n in plan] + [1] * extra, self.q_per_group))

    def _forward(self, plan, ids, pos, slots, rows, lengths, pick, state=None, patch=None) -> torch.Tensor:
        """Logits of the ``pick`` positions of ``plan``'s tokens packed into one sequence."""
        if state is None and self.mixed is not None:
            return self.mixed(plan, ids, pos, slots, rows, lengths, pick, patch)
        t = self._tensor
        packed = t([ids])
        if patch is not None:
            patch(packed[0])
        return self.e._forward(packed, t([pos]), self._view(plan, slots, rows, lengths, state), None, pick=t(pick))[0]

    def _run_recurrent(self, plan: list) -> tuple[torch.Tensor, dict]:
        """A model with Mamba-2 / Gated DeltaNet layers: the decoding requests in one pass of a token per batch row
        over their gathered state rows, every other request's tokens (prompt chunks) packed into one more pass, a
        document per request over its row (fresh at its first token; kernels/varlen.py); attention layers through
        the blocks either way."""
        out, picks = [], {}
        latent = self.e.model.config.multi_latent_attention  # (its attention takes one packed row only)
        decodes = [(seq, n) for seq, n in plan if n == 1 and seq.computed > 0 and not latent]
        if decodes:
            ids, pos, slots, rows, lengths, _, picks = self._pack(decodes)
            view = self._view(decodes, slots, rows, lengths, self._states(decodes))
            out.append(self.e._forward(self._tensor(ids)[:, None], self._tensor(pos)[:, None], view, None)[:, 0])
        chunks = [(seq, n) for seq, n in plan if seq.id not in picks]
        if chunks:
            ids, pos, slots, rows, lengths, pick, mine = self._pack(chunks)
            picks.update({sid: [len(decodes) + i for i in p] for sid, p in mine.items()})
            # each request's chunk a document of the packed row; the offsets stay on the host (the torch scans lay
            # the documents out by them without reading the GPU; fla and the convolution copy them over)
            cu = torch.tensor(list(itertools.accumulate((n for _, n in chunks), initial=0)), dtype=torch.int32)
            out.append(self._forward(chunks, ids, pos, slots, rows, lengths, pick, self._states(chunks, cu)))
        return torch.cat(out), picks

    def _states(self, plan: list, cu_seqlens: Optional[torch.Tensor] = None) -> PassStates:
        """The state rows of ``plan``'s requests for one pass (taken at a request's first pass)."""
        rows = self._tensor([self.states.row(seq, self.sched) for seq, _ in plan])
        fresh = self._tensor([seq.computed == 0 for seq, _ in plan]) if cu_seqlens is not None else None
        return PassStates(rows, fresh, cu_seqlens)

    def _next_tokens(self, plan: list, logits: torch.Tensor, picks: dict, on_token) -> list[Seq]:
        """After a pass over ``plan`` (its tokens counted as computed): the prompt log-probabilities asked for, and a
        token sampled for each request whose tokens are all computed; the requests that finished."""
        self._prompt_logprobs(plan, logits, picks)
        ready = [seq for seq, _ in plan if seq.computed == len(seq.tokens)]
        finished = [s for s in ready if s.new_max <= 0]  # asked for prompt log-probabilities only
        for s in finished:
            s.done = True
        ready = [s for s in ready if s.new_max > 0]
        if ready:
            finished += self._sample(ready, self._last_logits(ready, logits, picks), on_token)
        return finished

    def _last_logits(self, ready: list[Seq], logits: torch.Tensor, picks: dict) -> torch.Tensor:
        """The row of ``logits`` of each of ``ready``'s last computed token (a decode step's: all, as they are); the
        rows' index copied without waiting for the step's device work (``_tensor``)."""
        rows = [picks[s.id][-1] for s in ready]
        return logits if rows == list(range(logits.size(0))) else logits[self._tensor(rows)]

    def _choose(self, ready: list[Seq], last: torch.Tensor) -> torch.Tensor:
        """The next token of each of ``ready`` from its row of ``last``, on the device: greedy, or its sampler."""
        return last.argmax(-1) if all(s.params.temperature == 0 for s in ready) else self._sampler(ready)(last)

    def _prompt_logprobs(self, plan: list, logits: torch.Tensor, picks: dict) -> None:
        """Log-probabilities of the prompt tokens, chunk by chunk, for requests that asked for them."""
        for seq, n in plan:
            if not (seq.params.logprobs and seq.prompt_logprobs is None):
                continue
            start = seq.computed - n
            if start == 0:
                seq.prompt_acc = []
            lp = torch.log_softmax(logits[picks[seq.id]].float(), dim=-1)
            nxt = [q + 1 for q in range(start, seq.computed) if q + 1 < seq.prompt_len]
            if nxt:
                ids = torch.tensor([seq.tokens[q] for q in nxt], device=lp.device)
                seq.prompt_acc += lp[:len(nxt)].gather(-1, ids[:, None])[:, 0].tolist()
            if seq.computed >= seq.prompt_len:
                seq.prompt_logprobs = [None] + seq.prompt_acc

    def _sample(self, ready: list[Seq], last: torch.Tensor, on_token) -> list[Seq]:
        chosen = self._choose(ready, last)
        start = time.perf_counter()
        tok = chosen.tolist()  # (the host waits here for the step's device work)
        self.wait_s += time.perf_counter() - start
        if self.group is not None:  # every rank keeps rank 0's tokens
            tok = self.e._broadcast(torch.tensor(tok, device=self.device)).tolist()
        lp = top = None
        if any(s.params.logprobs for s in ready):
            lp, top = log_probs(last, tok, max(s.params.top_logprobs for s in ready))
        finished = []
        for i, (s, t) in enumerate(zip(ready, tok)):
            got = self._record(s, t, None if lp is None else lp[i], None if top is None else top[i])
            if on_token is not None:
                on_token(s, got)
            if s.done:
                finished.append(s)
        return finished

    def _sampler(self, seqs: list[Seq]) -> Sampler:
        """The sampler of ``seqs``' rows: their parameters and seeded generators."""
        return Sampler([s.params for s in seqs], self.device,
                       {i: s.generator for i, s in enumerate(seqs) if s.generator is not None})

    def _record(self, s: Seq, t: int, lp, top, placed: bool = False) -> Optional[int]:
        """Token ``t`` for ``s`` (None when it ends ``s`` without being kept: the end-of-document token);
        ``placed``: already in ``s.tokens`` (paged_async.py)."""
        p = s.params
        if t == self.e.eod and not p.ignore_eod:
            s.done, s.reason = True, "stop"
            return None
        s.generated.append(t)
        if not placed:
            s.tokens.append(t)
        if p.logprobs:
            s.logprobs.append(lp)
            if p.top_logprobs:
                s.top.append(top[:p.top_logprobs])
        detok = self.e.detokenize
        if p.stop and detok is not None and find_stop(detok(s.generated), p.stop) is not None:
            s.done, s.reason = True, "stop"
        elif len(s.generated) >= s.new_max:
            s.done = True
        return t

    def result(self, s: Seq) -> Result:
        p = s.params
        text = None
        if self.e.detokenize is not None:
            text = self.e.detokenize(s.generated)
            cut = find_stop(text, p.stop)
            text = text if cut is None else text[:cut]
        return Result(list(s.request.prompt), list(s.generated), s.reason, text,
                      list(s.logprobs) if p.logprobs else None, s.prompt_logprobs if p.logprobs else None,
                      list(s.top) if p.logprobs and p.top_logprobs else None)

    def startup_line(self) -> str:
        """What the pool and the decode path came to (the server prints it when it starts)."""
        graphs = f"CUDA graphs for batches {self.graphs.sizes}" if self.graphs is not None else \
            "no CUDA graphs" + ("" if self.graphed else " (tensor parallel, multi-latent attention, windows, sinks "
                                "or recurrent layers: not yet)")
        mixed = getattr(self.mixed, "graphs", None)
        graphs += f" and mixed steps of {mixed.sizes} tokens" if mixed is not None else ""
        attention = "Triton kernel" if self.kernel and self.device.type == "cuda" else "torch reference"
        rows = self.cfg.inference_dynamic_batching_max_requests
        states = "" if self.states is None else f", recurrent states: {rows} rows ({self.state_bytes / 2 ** 30:.3f} GB)"
        return (f" paged engine: {self.num_blocks - 1} blocks of {self.block_size} tokens "
                f"({(self.num_blocks - 1) * self.block_bytes / 2 ** 30:.3f} GB){states}, paged attention: {attention}, "
                f"{graphs}, GEMMs: {'cuBLASLt timed choice' if self.cublaslt else 'torch'}")

    def stats(self) -> dict:
        """What /health reports about the pool."""
        b = self.blocks
        return {"kv_blocks": self.num_blocks - 1, "kv_blocks_used": b.used, "kv_blocks_peak": b.peak,
                "kv_bytes_peak": b.peak * self.block_bytes, "prefix_cache_hit_blocks": self.sched.prefix_hits,
                "preemptions": self.sched.preemptions, "steps": self.steps,
                "step_ms_mean": round(1000 * self.step_s / max(self.steps, 1), 3),
                "device_wait_ms_mean": round(1000 * self.wait_s / max(self.steps, 1), 3),
                "decode_steps": self.decode_steps,
                "decode_step_ms_mean": round(1000 * self.decode_s / max(self.decode_steps, 1), 3),
                "mixed_step_ms_mean": round(1000 * (self.step_s - self.decode_s)
                                            / max(self.steps - self.decode_steps, 1), 3),
                "mixed_wait_ms_mean": round(1000 * self.mixed_wait_s / max(self.steps - self.decode_steps, 1), 3),
                **self.compile_stats()}

    def compile_stats(self) -> dict:
        """Under --torch-compile: the graphs compiled in this process and the frames left uncompiled (a failed
        compilation, or torch's recompile limit reached: those steps ran eager from then on), from torch's dynamo
        counters (the process's, which the server's engine alone compiles in). A warmed-up engine is expected to
        hold one graph for its MixedStep and, on a GPU, two for its decode graphs, and no uncompiled frame."""
        if not self.e.compile:
            return {}
        from torch._dynamo.utils import counters
        frames = counters["frames"]
        return {"compiled_graphs": counters["stats"]["unique_graphs"],
                "frames_not_compiled": frames["total"] - frames["ok"]}
