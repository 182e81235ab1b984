"""AdamW on the fp32 masters that also writes the model's bf16/fp16 weights, in one Triton pass over the
masters of a param group.

The on-device optimizer step of a mixed-precision run (MixedPrecisionAdam._step_on_device) used to run
torch's fused AdamW over the masters and then copy every master into its model weight
(``torch._foreach_copy_``), which reads each master a second time and launches a kernel set of its own.
The kernel here reads the master, its gradient and its two moments once, and writes the master, the
moments and the rounded model weight in the same pass.

The state stays torch.optim.AdamW's: ``exp_avg``, ``exp_avg_sq`` and the device ``step`` tensor in
``adam.state[master]``, created as AdamW's fused path creates them, and the hyperparameters are read from
its param groups at each step, so state_dict, checkpoints and resume see no difference. The moments may be held
in bf16 (--exp-avg-dtype / --exp-avg-sq-dtype bf16, paratron/optim/moments.py): read into fp32, updated there,
written back rounded. The formula is
torch's (decoupled weight decay ``p *= 1 - lr * wd``; ``m`` lerped towards ``g`` by ``1 - beta1``;
``v = beta2 v + (1 - beta2) g^2``; ``p -= lr / (1 - beta1^t) * m / (sqrt(v) / sqrt(1 - beta2^t) + eps)``),
with what torch's fused AdamW takes from our step: ``grad_scale`` (each gradient divided by it as it is
read: the clip coefficient, which leaves the gradient buffer itself unscaled) and ``found_inf`` (a
device 0/1 flag: 1 leaves everything, the step counter included, as it was). The step counter is read
by the kernel from its device tensor, so nothing waits for the host; the bias corrections are computed
in fp64 from it (``1 - beta^t`` cancels badly in fp32 for beta2 near 1 and small t). ``lr`` and the
other hyperparameters are plain fp32 kernel arguments: a scheduled learning rate compiles nothing new.

One launch steps many masters (all of a param group whose tensors have the same dtypes): a table on the device holds
each master's six addresses (master, gradient, moments, model weight, step counter), and each program finds its
master by a binary search over the masters' cumulative block counts. With one launch per master, a model of many small
tensors (BERT-340M: 302 a step) spent more time in the kernels' ramps and tails than in moving its bytes
(benchmarks/results/profile_bert_340m_mb32_h100_20261206.md). The table is built once and kept (``tables``, the
optimizer's) while the tensors stay where they are, so a step replayed from a CUDA graph reads the same addresses.
"""
from __future__ import annotations

import contextlib
import math
from typing import Optional

import torch

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU-only installs
    triton = None

BLOCK = 4096  # elements per program
NUM_WARPS = 8


def available(device: torch.device) -> bool:
    """Whether the kernel can step tensors on ``device`` (CUDA with Triton)."""
    return triton is not None and torch.device(device).type == "cuda"


def _state(adam: torch.optim.Optimizer, master: torch.Tensor) -> dict:
    """``adam.state[master]``, created as AdamW's fused path creates it on its first step (device fp32
    step counter at 0, zero moments) where it does not exist yet."""
    state = adam.state[master]
    if not state:
        state["step"] = torch.zeros((), dtype=torch.float32, device=master.device)
        state["exp_avg"] = torch.zeros_like(master, memory_format=torch.preserve_format)
        state["exp_avg_sq"] = torch.zeros_like(master, memory_format=torch.preserve_format)
    return state


def _check(master: torch.Tensor, tensors: list) -> None:
    if master.dtype != torch.float32:
        raise ValueError(f"fused AdamW steps fp32 masters, got {master.dtype}")
    for t in tensors:
        if t.numel() != master.numel() or not t.is_contiguous() or t.device != master.device:
            raise ValueError(f"fused AdamW needs contiguous tensors of the master's size and device, got "
                             f"{tuple(t.shape)} {t.device} (contiguous: {t.is_contiguous()}) for {tuple(master.shape)}")


def adamw_step_(adam: torch.optim.AdamW, outs: dict, grad_scale: Optional[torch.Tensor] = None,
                found_inf: Optional[torch.Tensor] = None, tables: Optional[dict] = None,
                grads: Optional[dict] = None) -> None:
    """One AdamW step of every parameter of ``adam``'s groups that has a ``.grad`` (the fp32 masters),
    state in ``adam.state``. ``outs``: {master: the model weight (bf16/fp16, contiguous, as many elements)
    the stepped master is also written into, rounded}; a master absent from it is only stepped.
    ``grad_scale``: device scalar each gradient is divided by as it is read; ``found_inf``: device 0/1
    scalar, 1 skips the update and leaves the step counters as they were (torch's fused AdamW's
    arguments of the same names). One kernel launch per param group and dtypes, plus one for the step counters;
    ``tables``: where the launches' address tables are kept between steps (built again when an address changes);
    ``grads``: {master: its gradient (fp32, bf16 or fp16), read in place of ``.grad``}: the gradient buffers
    themselves, which keep their addresses from step to step where fp32 copies of bf16 ones would not."""
    work, grad_of = [], (lambda m: m.grad) if grads is None else grads.get
    for gi, group in enumerate(adam.param_groups):
        if group.get("amsgrad") or group.get("maximize"):
            raise ValueError("fused AdamW has no amsgrad / maximize")
        if torch.is_tensor(group["lr"]):
            raise ValueError("fused AdamW takes the learning rate as a number")
        work += [(gi, group, m, _state(adam, m)) for m in group["params"] if grad_of(m) is not None]
    if not work:
        return
    advance_steps([w[3]["step"] for w in work], found_inf)
    batches: dict = {}
    for gi, group, m, state in work:
        rows = _rows(m, grad_of(m), state, outs.get(m))
        key = (gi,) + tuple(None if t is None else t.dtype for t in rows[1:5])
        batches.setdefault(key, (group, []))[1].append(rows)
    device = work[0][2].device
    tables = {} if tables is None else tables
    with torch.cuda.device(device) if device.type == "cuda" else contextlib.nullcontext():
        for key, (group, rows) in batches.items():
            _launch(_table(tables, key, rows, device), key[1:], group, grad_scale, found_inf)


def _rows(master: torch.Tensor, grad: torch.Tensor, state: dict, out: Optional[torch.Tensor]) -> tuple:
    """(master, gradient, first moment, second moment, model weight or None, step counter), checked."""
    m, v = state["exp_avg"], state["exp_avg_sq"]
    _check(master, [grad, m, v] + ([out] if out is not None else []))
    if not {m.dtype, v.dtype} <= {torch.float32, torch.bfloat16}:
        raise ValueError(f"fused AdamW holds the moments in fp32 or bf16 (no scale), got {m.dtype} / {v.dtype}")
    return master, grad, m, v, out, state["step"]


def _table(tables: dict, key: tuple, rows: list, device: torch.device) -> tuple:
    """(addresses [masters, 6] int64, cumulative block counts [masters + 1] int64, blocks, search depth, sizes
    [masters] int64) on the device for ``rows``: kept in ``tables`` under ``key`` with the addresses and sizes they
    were built for, built again where those changed."""
    addrs = [[0 if t is None else t.data_ptr() for t in r] for r in rows]
    sizes = [r[0].numel() for r in rows]
    seen = tuple(a for r in addrs for a in r) + tuple(sizes)
    hit = tables.get(key)
    if hit is not None and hit[0] == seen:
        return hit[1]
    cum = [0]
    for n in sizes:
        cum.append(cum[-1] + triton.cdiv(n, BLOCK))
    for a in addrs:
        a[4] = a[4] or a[0]  # no model weight: HAS_OUT is off for the whole batch, any address will do
    built = (torch.tensor(addrs, dtype=torch.int64, device=device), torch.tensor(cum, dtype=torch.int64, device=device),
             cum[-1], max(1, (len(rows) - 1).bit_length()), torch.tensor(sizes, dtype=torch.int64, device=device))
    tables[key] = (seen, built)
    return built


def advance_steps(steps: list, found_inf: Optional[torch.Tensor]) -> None:
    """Each step counter + 1, or + 0 where ``found_inf`` is 1 (torch's fused AdamW adds 1, then subtracts
    found_inf), without reading found_inf on the host: a 0-dim tensor where foreach takes a Scalar is read by
    ``.item()``, a host synchronisation every step; a list of tensors is not."""
    if found_inf is None:
        torch._foreach_add_(steps, 1.0)
    else:
        torch._foreach_add_(steps, [1.0 - found_inf] * len(steps))


def _launch(table: tuple, dtypes: tuple, group: dict, grad_scale: Optional[torch.Tensor],
            found_inf: Optional[torch.Tensor]) -> None:
    """The kernel over one batch's masters (``dtypes``: of the gradient, moments and model weight, None: none)."""
    addrs, cum, blocks, depth, sizes = table
    if blocks == 0:
        return
    lr, (beta1, beta2), eps, wd = float(group["lr"]), group["betas"], group["eps"], group["weight_decay"]
    g_t, m_t, v_t, out_t = (_TL[d] if d is not None else _TL[torch.float32] for d in dtypes)
    _adamw[(blocks,)](
        addrs, cum, sizes, grad_scale if grad_scale is not None else cum, found_inf if found_inf is not None else cum,
        addrs.size(0), lr, 1.0 - lr * wd, 1.0 - beta1, beta2, 1.0 - beta2, math.log(beta1), math.log(beta2), eps,
        G_T=g_t, M_T=m_t, V_T=v_t, OUT_T=out_t, DEPTH=depth, HAS_OUT=dtypes[3] is not None,
        HAS_SCALE=grad_scale is not None, HAS_INF=found_inf is not None, BLOCK=BLOCK, num_warps=NUM_WARPS)


if triton is not None:
    _TL = {torch.float32: tl.float32, torch.bfloat16: tl.bfloat16, torch.float16: tl.float16}

    @triton.jit
    def _adamw(addr_ptr, cum_ptr, size_ptr, scale_ptr, inf_ptr, count,
               lr, decay, one_minus_beta1, beta2, one_minus_beta2, log_beta1, log_beta2, eps,
               G_T: tl.constexpr, M_T: tl.constexpr, V_T: tl.constexpr, OUT_T: tl.constexpr, DEPTH: tl.constexpr,
               HAS_OUT: tl.constexpr, HAS_SCALE: tl.constexpr, HAS_INF: tl.constexpr, BLOCK: tl.constexpr):
        """AdamW over one block of BLOCK elements of one master of the batch: program b steps block b - cum[i] of
        master i, the last i with cum[i] <= b (``DEPTH`` halvings of [0, count)); ``decay`` = 1 - lr * wd,
        ``log_beta*`` the natural logarithms of the betas (for the bias corrections)."""
        b = tl.program_id(0).to(tl.int64)
        lo = b * 0
        hi = lo + count
        for _ in tl.static_range(DEPTH):
            mid = (lo + hi) // 2
            below = tl.load(cum_ptr + mid) <= b
            lo = tl.where(below, mid, lo)
            hi = tl.where(below, hi, mid)
        row = addr_ptr + 6 * lo
        p_ptr = tl.load(row).to(tl.pointer_type(tl.float32))
        g_ptr = tl.load(row + 1).to(tl.pointer_type(G_T))
        m_ptr = tl.load(row + 2).to(tl.pointer_type(M_T))
        v_ptr = tl.load(row + 3).to(tl.pointer_type(V_T))
        out_ptr = tl.load(row + 4).to(tl.pointer_type(OUT_T))
        step_ptr = tl.load(row + 5).to(tl.pointer_type(tl.float32))
        n = tl.load(size_ptr + lo)
        offs = (b - tl.load(cum_ptr + lo)) * BLOCK + tl.arange(0, BLOCK)
        if HAS_INF:  # an inf/nan gradient norm: nothing is read or written
            n = tl.where(tl.load(inf_ptr) == 0, n, 0)
        mask = offs < n
        g = tl.load(g_ptr + offs, mask=mask, other=0.0).to(tl.float32)
        if HAS_SCALE:
            g = tl.div_rn(g, tl.load(scale_ptr).to(tl.float32))
        p = tl.load(p_ptr + offs, mask=mask, other=0.0) * decay
        m = tl.load(m_ptr + offs, mask=mask, other=0.0).to(tl.float32)  # (held in fp32 or bf16)
        v = tl.load(v_ptr + offs, mask=mask, other=0.0).to(tl.float32)
        m = m + one_minus_beta1 * (g - m)  # torch's lerp for a weight below 0.5
        v = v * beta2 + one_minus_beta2 * (g * g)
        t = tl.load(step_ptr).to(tl.float64)
        step_size = (lr / (1.0 - tl.exp(t * log_beta1))).to(tl.float32)
        bc2_sqrt = tl.sqrt(1.0 - tl.exp(t * log_beta2)).to(tl.float32)
        denom = tl.div_rn(tl.sqrt_rn(v), bc2_sqrt) + eps
        p = p - step_size * tl.div_rn(m, denom)
        tl.store(p_ptr + offs, p, mask=mask)
        tl.store(m_ptr + offs, m.to(M_T), mask=mask)
        tl.store(v_ptr + offs, v.to(V_T), mask=mask)
        if HAS_OUT:
            tl.store(out_ptr + offs, p.to(OUT_T), mask=mask)
