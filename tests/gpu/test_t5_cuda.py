"""T5 on CUDA (skipped without a GPU): the bf16 model's loss and logits near the fp32 CPU model's under padding,
finite gradients, and greedy generation on the GPU equal to the CPU's for a short continuation."""
import pytest
import torch

from paratron.inference.sampling import SamplingParams
from paratron.inference.t5_generate import generate_t5
from paratron.model.t5 import T5Model
from tests.parallel.t5_cases import batch, tiny_config

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


def test_bf16_cuda_near_fp32_cpu():
    enc, dec, pad = batch()
    cpu = T5Model(tiny_config(), 96)
    gpu = T5Model(tiny_config(), 96, device="cuda", dtype=torch.bfloat16)
    gpu.load_state_dict({k: v.to(torch.bfloat16) for k, v in cpu.state_dict().items()})
    want = cpu(enc, dec, pad).detach()
    got = gpu(enc.cuda(), dec.cuda(), pad.cuda()).float().cpu()
    torch.testing.assert_close(got, want, rtol=0.05, atol=0.05)
    loss = gpu(enc.cuda(), dec.cuda(), pad.cuda(), labels=dec.roll(-1, 1).cuda()).float().mean()
    loss.backward()
    assert all(torch.isfinite(p.grad).all() for p in gpu.parameters() if p.grad is not None)


def test_greedy_generation_cuda_equals_cpu():
    enc, _, pad = batch()
    cpu = T5Model(tiny_config(), 96).eval()
    gpu = T5Model(tiny_config(), 96, device="cuda").eval()
    gpu.load_state_dict(cpu.state_dict())
    params = SamplingParams(max_new_tokens=6)
    want = generate_t5(cpu, enc, pad.long(), params, 96, eos=None)
    got = generate_t5(gpu, enc.cuda(), pad.long().cuda(), params, 96, eos=None).cpu()
    assert got.tolist() == want.tolist()
