import torch
from paratron import fp8
from paratron.fp8 import FP8State, Recipe
from paratron.kernels import fp8_block as fb
from paratron.kernels.experimental import deepgemm
print(torch.__version__, torch.cuda.get_device_name(), deepgemm.refusal("cuda"), fb.gemm_choice("cuda"))
torch.manual_seed(0)
a, b = torch.randn(384, 512, device="cuda"), torch.randn(256, 512, device="cuda")
aq, sa = fb.quantize_tiles(a)
bq, sb = fb.quantize_tiles(b)
ref = fb.block_mm(aq, sa, bq, sb, False, torch.float32, "emulate")
for p in ("scaled_mm", "dequant", "deepgemm"):
    try:
        o0 = torch.randn(384, 256, device="cuda")
        o = o0.clone()
        fb.block_mm_accumulate(o, aq, sa, bq, sb, p)
        print("acc", p, ((o - o0 - ref).norm() / ref.norm()).item())
    except Exception as e:
        print("acc", p, "ERR", repr(e)[:300])


def lin(path, wg, fused, compiled):
    torch.manual_seed(1)
    x = torch.randn(2, 256, 512, device="cuda", dtype=torch.bfloat16).requires_grad_()
    g = torch.randn(2, 256, 384, device="cuda", dtype=torch.bfloat16)
    w = (torch.randn(384, 512, device="cuda") * 0.05).requires_grad_()
    mg = torch.zeros(384, 512, device="cuda")
    st = FP8State(Recipe(format="e4m3", recipe="blockwise", block_gemm=path, fp8_wgrad=wg))
    f = lambda a, b: fp8.fp8_linear(a, b, st, mg if fused else None)  # noqa: E731
    if compiled:
        f = torch.compile(f, fullgraph=True)
    tot = torch.zeros_like(mg)
    for i in range(2):
        w.grad = None
        f(x[i], w).backward(g[i])
        if not fused:
            tot += w.grad
    return mg if fused else tot, x.grad


for path in ("scaled_mm", "dequant"):
    for wg in (True, False):
        for c in (False, True):
            try:
                (u, ux), (fz, fx) = lin(path, wg, False, c), lin(path, wg, True, c)
                print("linear", path, "fp8_wgrad", wg, "compiled", c, "rel", ((fz - u).norm() / u.norm()).item(),
                      "dgrad equal", torch.equal(ux, fx))
            except Exception as e:
                print("linear", path, wg, c, "ERR", repr(e)[:400])
