import torch
from paratron.parallel import fp8_mlp
torch.manual_seed(0)
for (m, f, act, bias) in ((65536, 4096, 1, True), (4096, 1024, 1, False), (272, 1000, 1, True), (4096, 1024, 0, False)):
    cols = 2 * f if act == 0 else f
    h = torch.randn(m, cols, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(cols, device="cuda", dtype=torch.bfloat16) if bias else None
    d = torch.randn(m, f, device="cuda", dtype=torch.bfloat16)
    preset = torch.tensor(37.5, device="cuda")
    q, qt, sc, cur, db = torch.ops.paratron.mlp_act_fp8_backward(h, b, d, preset, act, True, 0)
    torch.cuda.synchronize()
    a, bt = qt.view(torch.uint8), q.t().contiguous().view(torch.uint8)
    diff = (a != bt)
    rq = fp8_mlp.grad_fp8_reference(h, b, d, preset, act, True, 0)[0]
    print(m, f, act, bias, "best", fp8_mlp._grad_cast.best_config, "torch.equal:", torch.equal(qt, q.t()),
          "uint8 differ frac:", diff.float().mean().item(),
          "qt vs ref.T differ:", (a != rq.t().contiguous().view(torch.uint8)).float().mean().item(),
          "q vs ref differ:", (q.view(torch.uint8) != rq.view(torch.uint8)).float().mean().item())
    idx = diff.nonzero()[:5].tolist()
    for j, i in idx:
        print("   qt[%d,%d]=%d q[%d,%d]=%d ref=%d" % (j, i, a[j, i].item(), i, j, q.view(torch.uint8)[i, j].item(), rq.view(torch.uint8)[i, j].item()))
    x = torch.randn(m, f, device="cuda", dtype=torch.bfloat16)
    q2, qt2, _, _ = torch.ops.paratron.cast_fp8(x, preset, True, 0)
    print("   cast: uint8 differ", (qt2.view(torch.uint8) != q2.t().contiguous().view(torch.uint8)).float().mean().item())
