"""The bytes a micro-batch's memory-bound kernels move, counted (paratron plan's time model,
paratron/plan/traffic.py, takes them): one layer's forward and backward and the rest's (embedding, final norm, loss
head), run on the CPU at the model's widths and two short sequences under a dispatch mode that records each aten
operation's input and output bytes by the region of paratron's code that issued it (the innermost paratron file
of the forward's call stack; in the backward the stack autograd's anomaly mode kept for the node). Matmuls and
the attention core are left out (their time is the FLOPs'; bf16 and fp16 ones run in fp32, rounded back, since
a CPU without bf16 instructions runs them several times slower), views and allocations move nothing. Here, in train,
because it builds a model; the planner is given the counts."""
from __future__ import annotations

import contextlib
import sys
from typing import Optional

import torch
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from ..config import Config
from ..config.check_hybrid import is_hybrid_stack
from ..config.values import BLOCKWISE_TILE
from ..plan.traffic import Traffic
from .distributed import build_dims
from .host_ops import as_kind, kind_copies, one_rank_eager, tile_aligned
from .step import build_model_chunks

# Operations whose bytes are not counted: matmuls (their time is the FLOPs') and the attention core (FlashAttention
# on the GPU: its traffic is inside its FLOP time), by name fragment.
MATMULS = ("aten.mm.", "aten.addmm.", "aten.bmm.", "aten.baddbmm.", "aten._grouped_mm.", "aten._scaled_mm.",
           "aten._scaled_grouped_mm.", "cublaslt_addmm", "aten.linear.", "aten.matmul.")
ATTENTION = ("attention",)
MOVES_NOTHING = ("empty", "_unsafe_view", "detach", "lift_fresh", "_local_scalar_dense")
REGIONS = {"model/norms.py": "norm", "kernels/rotary.py": "rope", "model/rotary.py": "rope",
           "kernels/swiglu.py": "swiglu", "parallel/cross_entropy.py": "loss", "kernels/cross_entropy.py": "loss",
           "kernels/accumulate.py": "accumulate"}
OWN = ("paratron/train/traffic.py",)


def nbytes(t: torch.Tensor) -> int:
    """The bytes a kernel touches of ``t``: its elements, at most its storage's (a broadcast view reads once)."""
    if t.device.type == "meta" or not t.is_floating_point() and t.dtype not in (torch.int64, torch.int32,
                                                                               torch.bool, torch.int8, torch.uint8):
        return 0
    return min(t.numel(), t.untyped_storage().nbytes() // t.element_size()) * t.element_size()


def region_of(files: list[str]) -> str:
    """The region of the innermost paratron file of a call stack (``other`` where no table entry)."""
    inner = [f.split("/paratron/", 1)[1] for f in files if "/paratron/" in f and not f.endswith(OWN)]
    if not inner:
        return "other"
    region = REGIONS.get(inner[-1], "other")
    experts = any(f.endswith(("model/moe_experts.py", "model/moe_wgrad.py")) for f in inner)
    if experts and region in ("swiglu", "other"):  # (the experts' weight-sized bytes: split over EP x expert-TP)
        return region + "-experts"
    return region


def current_region() -> tuple[str, str]:
    """(region, phase F/B) of the operation being dispatched."""
    node = torch._C._current_autograd_node()
    if node is not None:
        lines = node.metadata.get("traceback_") or []
        return region_of([line.split('"')[1] for line in lines if '"' in line]), "B"
    files, frame = [], sys._getframe()
    while frame is not None:
        files.append(frame.f_code.co_filename)
        frame = frame.f_back
    return region_of(files[::-1]), "F"


class Runs:
    """Fused accounting: a run of consecutive counted operations of one label is one kernel, which reads the
    storages entering it once and writes a storage once when something outside the run reads it."""

    def __init__(self):
        self.bytes: dict = {}
        self.run, self.label, self.n = None, None, 0
        self.producer: dict = {}  # storage -> (run, label, bytes) of the run that last wrote it
        self.read: set = set()
        self.written: set = set()

    def _add(self, label, n: int) -> None:
        self.bytes[label] = self.bytes.get(label, 0) + n

    def reads(self, key, n: int, run) -> None:
        """A read of storage ``key`` (``n`` bytes) by ``run`` (None: an uncounted operation)."""
        made = self.producer.get(key)
        if made is not None and made[0] != run and (made[0], key) not in self.written:
            self.written.add((made[0], key))
            self._add(made[1], made[2])
        if run is not None and (made is None or made[0] != run) and key not in self.read:
            self.read.add(key)
            self._add(self.label, n)

    def op(self, label, ins: list, outs: list) -> None:
        """A counted operation of ``label`` (None: uncounted, which ends the run)."""
        if label is None or label != self.label:
            self.n, self.label, self.read = self.n + 1, label, set()
            self.run = None if label is None else self.n
        for key, n in ins:
            self.reads(key, n, self.run)
        for key, n in outs:
            self.producer[key] = (self.run, label, n)
            self.written.discard((self.run, key))


def storages(tensors) -> list[tuple[int, int]]:
    """(storage key, bytes touched) of each tensor in a pytree of arguments or results."""
    return [(t.untyped_storage().data_ptr(), nbytes(t)) for t in tree_flatten(tensors)[0]
            if isinstance(t, torch.Tensor) and t.device.type != "meta"]


# Half-precision matmuls the count runs in fp32 (CPUs without bf16 instructions run them several times slower; the
# count needs only their outputs' shapes and dtypes, and values close to the model's for the routing)
UPCAST = ("aten.mm.default", "aten.addmm.default", "aten.bmm.default", "aten.baddbmm.default",
          "aten._grouped_mm.default")
HALF = (torch.bfloat16, torch.float16)


def compute(func, args: tuple, kwargs: dict):
    """``func(*args, **kwargs)``, or for a bf16 / fp16 matmul of UPCAST on the CPU its fp32 product rounded to the
    dtype the matmul returns."""
    tensors = [a for a in args if isinstance(a, torch.Tensor)]
    if str(func) not in UPCAST or not tensors or tensors[0].dtype not in HALF or tensors[0].device.type != "cpu":
        return func(*args, **kwargs)
    dtype = kwargs.get("out_dtype") or tensors[0].dtype
    wide = [a.float() if isinstance(a, torch.Tensor) and a.dtype in HALF else a for a in args]
    return func(*wide, **{k: v for k, v in kwargs.items() if k != "out_dtype"}).to(dtype)


CORE = "paratron_attention_core"  # the autograd metadata key that marks a node of the attention core's backward


def mark_core(out, inputs) -> None:
    """Mark the autograd nodes between ``out`` and ``inputs`` (those a scaled_dot_product_attention call made)."""
    kept = [t.grad_fn for t in inputs if isinstance(t, torch.Tensor) and t.grad_fn is not None]  # (alive: ids hold)
    stop = {id(node) for node in kept}
    todo = [out.grad_fn] if isinstance(out, torch.Tensor) and out.grad_fn is not None else []
    while todo:
        node = todo.pop()
        if node is None or id(node) in stop or CORE in node.metadata or type(node).__name__ == "AccumulateGrad":
            continue
        node.metadata[CORE] = True
        todo += [n for n, _ in node.next_functions]


class CoreAttention(TorchFunctionMode):
    """Runs torch's scaled_dot_product_attention with ``counter.in_core`` set and marks its backward's nodes: on a
    CPU it may decompose into aten operations (the math path: attention dropout, unequal head dims) which the GPU
    runs inside one attention kernel, whose traffic is inside its FLOP time."""

    def __init__(self, counter: "ByteCounter"):
        super().__init__()
        self.counter = counter

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is not F.scaled_dot_product_attention:
            return func(*args, **kwargs)
        self.counter.in_core += 1
        try:
            out = func(*args, **kwargs)
        finally:
            self.counter.in_core -= 1
        mark_core(out, [*args, *kwargs.values()])
        return out


def core_operation(counter: "ByteCounter") -> bool:
    """Whether the operation being dispatched is the attention core's (its forward, or a node of its backward)."""
    node = torch._C._current_autograd_node()
    return counter.in_core > 0 or (node is not None and CORE in node.metadata)


class ByteCounter(TorchDispatchMode):
    """Each counted aten operation's bytes by (region, phase): ``eager`` (inputs + outputs) and ``fused.bytes``
    (per region's runs, Runs); ``compiled.bytes`` by phase, every run of counted operations fused. Enter it with
    :class:`CoreAttention` to leave out the operations of a decomposed attention core (:func:`counting`)."""

    def __init__(self):
        super().__init__()
        self.eager: dict = {}
        self.fused, self.compiled = Runs(), Runs()
        self.in_core = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = compute(func, args, kwargs or {})
        name = str(func)
        if func.is_view:
            return out
        ins, outs = storages((args, kwargs)), storages(out)
        if any(s in name for s in MOVES_NOTHING):  # a fresh allocation: whoever wrote its memory before is gone
            for key, _ in outs if "empty" in name else ():
                self.fused.producer.pop(key, None)
                self.compiled.producer.pop(key, None)
            return out
        if any(s in name for s in MATMULS + ATTENTION) or core_operation(self):
            self.fused.op(None, ins, outs)
            self.compiled.op(None, ins, outs)
            return out
        label = current_region()
        self.eager[label] = self.eager.get(label, 0) + sum(n for _, n in ins) + sum(n for _, n in outs)
        self.fused.op(label, ins, outs)
        self.compiled.op(label[1], ins, outs)
        return out


WIDTHS = ("hidden_size", "ffn_hidden_size", "kv_channels", "moe_ffn_hidden_size", "moe_shared_expert_intermediate_size")
LINEAR_WIDTHS = ("linear_key_head_dim", "linear_value_head_dim", "mamba_num_heads")  # (Mamba-2's heads follow hidden)
MLA_WIDTHS = ("q_lora_rank", "kv_lora_rank", "qk_head_dim", "qk_pos_emb_head_dim", "v_head_dim")
NARROW_TO = 512  # the hidden size the counted copy is narrowed towards (the CPU's time: FP8 matmuls are slow there)


def widths_of(cfg: Config) -> tuple:
    """The width fields narrowed: hidden, FFN, head, expert and (multi-latent attention) the latent ranks and
    head dimensions."""
    return WIDTHS + (MLA_WIDTHS if cfg.model.multi_latent_attention else ()) + \
        (LINEAR_WIDTHS if is_hybrid_stack(cfg.model) else ())


def narrowing(cfg: Config) -> int:
    """The power of two the counted copy divides every width by (widths_of and the vocabulary): an elementwise
    operation's bytes per token grow as one of those widths, so the counts are multiplied back."""
    m, k = cfg.model, 1
    align = BLOCKWISE_TILE if tile_aligned(cfg) else 8  # a blockwise FP8 copy's widths stay whole 128-wide tiles
    widths = [getattr(m, w) for w in widths_of(cfg) if getattr(m, w)] + [cfg.padded_vocab_size]
    while m.hidden_size // (2 * k) >= NARROW_TO and all(w % (2 * k * align) == 0 for w in widths):
        k *= 2
    return k


def short_copy(cfg: Config, layers: int, seq: int, k: int = 1, kind: Optional[dict] = None) -> Config:
    """``cfg``'s model at its widths / ``k`` with ``layers`` layers (of one ``kind``: host_ops.kind_copies') and a
    ``seq``-token sequence, on one rank, eager."""
    c = as_kind(cfg.unfrozen(), kind or {}, layers)
    m = c.model
    m.num_layers, m.seq_length, m.mtp_num_layers = layers, seq, None
    m.max_position_embeddings = max(m.max_position_embeddings or seq, seq)
    for w in widths_of(cfg):
        if getattr(m, w):
            setattr(m, w, getattr(m, w) // k)
    c.data.vocab_size, m.make_vocab_size_divisible_by = cfg.padded_vocab_size // k, 8
    if m.num_experts:  # every layer of the MoE kind (a pattern of the model's layers does not fit one or two)
        m.moe_layer_freq = 1
    return one_rank_eager(c)


@contextlib.contextmanager
def counting():
    """A ByteCounter that leaves out the attention core's operations, however torch runs it here."""
    counter = ByteCounter()
    with CoreAttention(counter), counter:
        yield counter


def count_bytes(cfg: Config) -> dict:
    """{(region, phase, "eager" / "fused") or ("compiled", phase): bytes} of one forward and backward on the CPU."""
    model = build_model_chunks(cfg, build_dims(cfg), torch.device("cpu"))[0]
    tokens = torch.randint(0, min(500, cfg.data.vocab_size), (1, cfg.model.seq_length),
                           generator=torch.Generator().manual_seed(0))
    with torch.autograd.set_detect_anomaly(True, check_nan=False), counting() as c:
        model(tokens, labels=tokens).float().sum().backward()
    out = {(*k, "eager"): n for k, n in c.eager.items()}
    out.update({(*k, "fused"): n for k, n in c.fused.bytes.items() if k is not None})
    out.update({("compiled", k): n for k, n in c.compiled.bytes.items() if k is not None})
    return out


def linear(counts: dict, seqs: tuple) -> dict:
    """{key: per layer or rest, as (fixed, per token) fitted through the two sequences' counts}."""
    (s1, a), (s2, b) = zip(seqs, counts)
    out = {}
    for k in set(a) | set(b):
        x, y = a.get(k, 0), b.get(k, 0)
        per = (y - x) / (s2 - s1)
        out[k] = (x - per * s1, per)
    return out


def split(one: dict, two: dict) -> tuple[dict, dict]:
    """(one layer's, the rest's) of the counts of one- and two-layer copies."""
    keys = set(one) | set(two)
    return ({k: two.get(k, 0) - one.get(k, 0) for k in keys}, {k: 2 * one.get(k, 0) - two.get(k, 0) for k in keys})


SEQS = (32, 64)  # the two sequence lengths counted (tokens of one micro-batch): bytes = fixed + per token x tokens


def seqs_of(cfg: Config) -> tuple:
    """The two sequence lengths counted: SEQS, or for Mamba-2 / Gated DeltaNet layers two and four whole chunks of
    their scans (so that the intra-chunk work per token is the run's, as with chunks of --mamba-chunk-size)."""
    m = cfg.model
    if not is_hybrid_stack(m):
        # (blockwise: whole tiles)
        return tuple(s * BLOCKWISE_TILE // SEQS[0] for s in SEQS) if tile_aligned(cfg) else SEQS
    return 2 * m.mamba_chunk_size, 4 * m.mamba_chunk_size


def kind_bytes(cfg: Config, kind: dict, k: int, seqs: tuple) -> tuple[dict, dict]:
    """{key: (fixed, per token)} of one layer of ``kind`` and of the rest, multiplied back from the narrowed copy."""
    runs = [split(count_bytes(short_copy(cfg, 1, s, k, kind)), count_bytes(short_copy(cfg, 2, s, k, kind)))
            for s in seqs]
    return tuple({key: (fixed * k * k, tok * k) for key, (fixed, tok) in linear([r[i] for r in runs], seqs).items()}
                 for i in (0, 1))


def traffic_of(cfg: Config) -> Traffic:
    """The counted bytes of one layer and of the rest (plan/traffic.Traffic), fixed and per token: counted on a
    copy narrowed by ``narrowing``, per-token bytes multiplied back by the factor, fixed ones (weight-sized:
    two widths) by its square. A hybrid stack counts each kind of layer apart (host_ops.kind_copies): one layer is
    the mean over the pattern, so that the layers' sum is the pattern's."""
    k, seqs, layer, rest = narrowing(cfg), seqs_of(cfg), {}, {}
    for share, kind in kind_copies(cfg):
        one, others = kind_bytes(cfg, kind, k, seqs)
        for into, got in ((layer, one), (rest, others)):
            for key, (fixed, tok) in got.items():
                f0, t0 = into.get(key, (0.0, 0.0))
                into[key] = (f0 + share * fixed, t0 + share * tok)

    def rows(d: dict) -> tuple:
        regions = sorted({k[:2] for k in d if k[0] != "compiled"})
        return tuple((r, p, *d.get((r, p, "eager"), (0, 0)), *d.get((r, p, "fused"), (0, 0))) for r, p in regions)

    def compiled(d: dict, phases=("F", "B")) -> tuple:
        return tuple(sum(d.get(("compiled", p), (0, 0))[i] for p in phases) for i in (0, 1))
    return Traffic(rows(layer), rows(rest), compiled(layer) + compiled(rest), compiled(layer, ("F",)))


def traffic_for(cfg: Config, kind: Optional[str]) -> Optional[Traffic]:
    """What a GPU plan of ``kind`` takes as the step's memory-bound bytes: counted (None: not a GPU plan)."""
    return None if kind is None else traffic_of(cfg)
