"""The paged decode kernel's split-context path (kernels/paged_attention.py, flash-decoding): the host's choice of
the split count, and the split and combine kernels against the torch reference through Triton's CPU interpreter
(forced split counts, splits that see no key, a sliding window, sinks) and compiled for Hopper without a GPU."""
import pytest

from paratron.kernels.paged_attention import BLOCK_T, decode_splits


def test_decode_splits_fills_the_gpu_only_when_the_programs_do_not():
    sms = 132
    # enough (token, group) programs already: the single-pass kernel
    assert decode_splits(2 * sms, 1 << 20, sms) == 1
    assert decode_splits(4096, 1 << 20, sms) == 1
    # batch 1, 8 groups: about 2 programs per multiprocessor (ceil(264 / 8)), given a wide enough table
    assert decode_splits(8, 131072, sms) == 33
    assert decode_splits(100, 131072, sms) == 3
    assert decode_splits(2 * sms - 1, 131072, sms) == 2
    # capped so that each split keeps 4 x BLOCK_T positions of the widest context the tables describe
    assert decode_splits(8, 2048, sms) == 2048 // (4 * BLOCK_T) == 8
    assert decode_splits(8, 4 * BLOCK_T * 3 + 1, sms) == 3
    assert decode_splits(8, 4 * BLOCK_T - 1, sms) == 1  # too narrow to split at all
    assert decode_splits(1, 1 << 20, 16) == 32
    assert decode_splits(0, 1 << 20, sms) == 1
    for programs in (1, 7, 8, 50, 263, 264, 1000):
        for span in (1, 64, 1100, 4096, 1 << 17):
            n = decode_splits(programs, span, sms)
            assert n >= 1 and (n == 1 or (programs * (n - 1) < 2 * sms and n * 4 * BLOCK_T <= span))


SPLIT = r"""
import torch
import paratron.kernels.paged_attention as pa
from paratron.kernels.paged_attention import paged_attention_reference

launches = []


class Counted:
    # wraps a kernel to record each launch's grid (which path ran)
    def __init__(self, name):
        self.name, self.kernel = name, getattr(pa, name)

    def __getitem__(self, grid):
        launches.append((self.name, tuple(grid)))
        return self.kernel[grid]


for name in ("_paged_kernel", "_paged_split_kernel", "_paged_combine_kernel"):
    setattr(pa, name, Counted(name))

torch.manual_seed(0)
# block sizes under (not a power of two) and at the kernel's 64-key tile; a token of one key (every split but the
# first empty), one shorter than a chunk, contexts ending mid-chunk and on a chunk's edge; tables whose unused
# entries point anywhere; bf16 and fp32
for bs, g, qpg, d, dtype, tol in ((5, 2, 4, 16, torch.bfloat16, 2e-2), (64, 2, 3, 16, torch.float32, 1e-5)):
    blocks = 80
    k_pool, v_pool = torch.randn(2, blocks, bs, g, d).to(dtype)
    tables = torch.randint(1, blocks, (3, 1100 // bs + 2))  # wide enough for the automatic choice to split
    lengths = torch.tensor([1, 37, 300, 256, 130])
    rows = torch.tensor([0, 0, 1, 2, 2])
    q = torch.randn(5, g, qpg, d).to(dtype)
    sinks = torch.randn(g * qpg)
    for splits in SPLITS:
        for window, sink in ((None, None), (3, None), (100, None), (None, sinks), (70, sinks)):
            launches.clear()
            got = torch.ops.paratron.paged_attention(q, k_pool, v_pool, tables, rows, lengths, 0.25,
                                                     -1 if window is None else window, sink, splits)
            assert [k for k, _ in launches] == ["_paged_split_kernel", "_paged_combine_kernel"], launches
            assert launches[0][1] == (5 * g, splits), launches
            want = paged_attention_reference(q, k_pool, v_pool, tables, rows, lengths, 0.25, window, sink)
            assert got.shape == q.shape and got.dtype == dtype and torch.isfinite(got).all()
            err = ((got.double() - want.double()).norm() / want.double().norm()).item()
            assert err <= tol, (bs, splits, window, sink is not None, dtype, err)
            # every token alone too (each token's error, not the batch's)
            for i in range(5):
                e = ((got[i].double() - want[i].double()).norm() / want[i].double().norm()).item()
                assert e <= 2 * tol, (bs, splits, window, sink is not None, i, e)
    # automatic: 5 tokens x 2 groups is far short of 2 x 132 programs, so the tables' width decides
    launches.clear()
    got = torch.ops.paratron.paged_attention(q, k_pool, v_pool, tables, rows, lengths, 0.25)
    auto = pa.decode_splits(5 * g, tables.size(1) * bs, pa.DEFAULT_SMS)
    assert auto > 1 and launches[0] == ("_paged_split_kernel", (5 * g, auto)), (auto, launches)
    want = paged_attention_reference(q, k_pool, v_pool, tables, rows, lengths, 0.25)
    assert ((got.double() - want.double()).norm() / want.double().norm()).item() <= tol
    # one split: the single-pass kernel alone
    launches.clear()
    one = torch.ops.paratron.paged_attention(q, k_pool, v_pool, tables, rows, lengths, 0.25, -1, None, 1)
    assert launches == [("_paged_kernel", (5 * g,))], launches
    assert ((one.double() - want.double()).norm() / want.double().norm()).item() <= tol
print("ok")
"""


@pytest.mark.parametrize("splits", ["(3,)", pytest.param("(2, 3, 4)", marks=pytest.mark.slow)])  # (CI: one count)
def test_split_paged_attention_matches_torch_in_the_interpreter(splits):
    pytest.importorskip("triton")
    from tests.interpret import interpret
    interpret(f"SPLITS = {splits}\n" + SPLIT)


@pytest.mark.parametrize("index", ["*i64", "*i32"])
def test_split_and_combine_kernels_compile_for_sm90(index):
    """Both kernels of the split path lower for Hopper (the chunk bounds with lengths of either index type)."""
    pytest.importorskip("triton")
    from paratron.kernels import paged_attention as pa
    from tests.unit.test_triton_sm90 import compile_sm90
    if not hasattr(pa, "_paged_split_kernel"):
        pytest.skip("paratron's kernels module did not see Triton")
    types = {"q_ptr": "*bf16", "k_ptr": "*bf16", "v_ptr": "*bf16", "tab_ptr": "*i32", "row_ptr": index,
             "len_ptr": index, "m_ptr": "*fp32", "l_ptr": "*fp32", "acc_ptr": "*fp32", "scale": "fp32"}
    out = compile_sm90(pa._paged_split_kernel, types, {"QPG": 4, "QB": 16, "D": 64, "BS": 16, "BT": 64})
    assert "cubin" in out.asm and len(out.asm["cubin"]) > 0
    types = {"m_ptr": "*fp32", "l_ptr": "*fp32", "acc_ptr": "*fp32", "out_ptr": "*bf16", "sink_ptr": "*fp32"}
    for sink in (False, True):
        out = compile_sm90(pa._paged_combine_kernel, types, {"QPG": 4, "QB": 16, "D": 64, "SINK": sink})
        assert "cubin" in out.asm and len(out.asm["cubin"]) > 0
