"""Triton kernels written before a GPU could run them compile for Hopper here, without a GPU: Triton's
front end and its NVIDIA back end type-check and lower a kernel to a cubin for sm90 on any machine (Triton
is in the test extras; skipped where it is absent). It catches what the H200 rejected once: the paged
kernel's window bound mixing int32 and int64 (lengths of either index type)."""
import pytest


triton = pytest.importorskip("triton")
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402


def compile_sm90(kernel, types: dict, constexprs: dict, aligned=(), num_warps: int = 4):
    """``types``: argument name -> Triton type ("*bf16", "i32", "fp32"); every argument not named is i32.
    ``aligned``: the arguments Triton's launcher would find divisible by 16 (pointers, sizes)."""
    names = kernel.arg_names
    sig = {n: "constexpr" if n in constexprs else types.get(n, "i32") for n in names}
    attrs = {(names.index(n),): [["tt.divisibility", 16]] for n in aligned}
    src = ASTSource(fn=kernel, signature=sig, constexprs={(names.index(n),): v for n, v in constexprs.items()},
                    attrs=attrs)
    return triton.compile(src, target=GPUTarget("cuda", 90, 32), options={"num_warps": num_warps})


def sm90_cubin(module: str, kernel: str, types: dict, constexprs: dict) -> bytes:
    """The cubin of ``paratron.kernels.<module>.<kernel>`` compiled for Hopper (skipped where the module did not
    see Triton)."""
    import importlib
    mod = importlib.import_module(f"paratron.kernels.{module}")
    if not hasattr(mod, kernel):
        pytest.skip("paratron's kernels module did not see Triton")
    return compile_sm90(getattr(mod, kernel), types, constexprs).asm.get("cubin", b"")


@pytest.mark.parametrize("sink", [False, True])
@pytest.mark.parametrize("index", ["*i64", "*i32"])
def test_paged_attention_kernel_compiles_for_sm90(sink, index):
    from paratron.kernels import paged_attention as pa
    if not hasattr(pa, "_paged_kernel"):
        pytest.skip("paratron's kernels module did not see Triton")
    types = {"q_ptr": "*bf16", "k_ptr": "*bf16", "v_ptr": "*bf16", "out_ptr": "*bf16", "tab_ptr": "*i32",
             "row_ptr": index, "len_ptr": index, "sink_ptr": "*fp32", "scale": "fp32"}
    out = compile_sm90(pa._paged_kernel, types, {"QPG": 4, "QB": 16, "D": 64, "BS": 16, "BT": 32, "SINK": sink})
    assert "cubin" in out.asm and len(out.asm["cubin"]) > 0


@pytest.mark.parametrize("index", ["*i64", "*i32"])
def test_paged_tile_kernel_compiles_for_sm90(index):
    """The prompt-chunk kernel: each row's own span passed to the shared key loop as column vectors."""
    from paratron.kernels import paged_attention as pa
    if not hasattr(pa, "_paged_tile_kernel"):
        pytest.skip("paratron's kernels module did not see Triton")
    types = {"q_ptr": "*bf16", "k_ptr": "*bf16", "v_ptr": "*bf16", "out_ptr": "*bf16", "tab_ptr": "*i32",
             "row_ptr": index, "len_ptr": index, "tile_ptr": index, "sink_ptr": "*fp32", "scale": "fp32"}
    # full tiles; a mixed step's decodes (narrow); dots in bf16 (the GPU's path) and in fp32
    for sink, rows, lowp in ((False, 64, True), (True, 64, True), (False, 16, True), (False, 64, False)):
        out = compile_sm90(pa._paged_tile_kernel, types,
                           {"QPG": 4, "QP": 4, "R": rows, "D": 64, "BS": 16, "BT": pa.TILE_BLOCK_T, "SINK": sink,
                            "LOWP": lowp})
        assert "cubin" in out.asm and len(out.asm["cubin"]) > 0


@pytest.mark.parametrize("split", [False, True])
def test_decode_rotary_kernel_compiles_for_sm90(split):
    """kernels/decode_rotary.py: the rotation's bf16 rounding, the cache write, the new token from registers; split,
    the partials combined by a second kernel or by the group's last split (its counter); with the programmatic
    dependent launch's wait and trigger."""
    types = {"qkv_ptr": "*bf16", "cos_ptr": "*fp32", "sin_ptr": "*fp32", "k_ptr": "*bf16", "v_ptr": "*bf16",
             "pad_ptr": "*i64", "slot_ptr": "*i64", "out_ptr": "*bf16", "m_ptr": "*fp32", "l_ptr": "*fp32",
             "acc_ptr": "*fp32", "count_ptr": "*i32", "scale": "fp32", "qn_ptr": "*bf16", "kn_ptr": "*bf16",
             "eps": "fp32"}
    for arrive, pdl, norm in (((False, False, False), (True, True, True)) if split
                              else ((False, False, False), (False, True, True), (False, True, False))):
        from paratron.kernels import decode_rotary
        if not hasattr(decode_rotary, "_decode_rotary_kernel"):
            pytest.skip("paratron's kernels module did not see Triton")
        out = compile_sm90(decode_rotary._decode_rotary_kernel, types,
                           {"QPG": 4, "QB": 16, "D": 64, "BT": 64, "SPLIT": split, "ARRIVE": arrive, "PDL": pdl,
                            "NORM": norm, "EARLY": 256 if pdl else 0})
        assert len(out.asm.get("cubin", b"")) > 0
        ptx = out.asm["ptx"]
        assert ("griddepcontrol.wait" in ptx) == pdl and ("atom" in ptx) == arrive
        assert "prefetch.global" not in ptx
        assert ("rsqrt" in ptx) == norm  # the heads' RMSNorm statistics (--qk-layernorm)
        if pdl:  # the slot, the padding and the cache's first 256 slots read before the wait
            before = ptx[:ptx.index("griddepcontrol.wait")].count("ld.global")
            assert before >= 2 + 2 * 256 * 64 * 2 // (16 * 256), before


@pytest.mark.parametrize("pdl", [False, True])
def test_decode_qkv_attention_kernel_compiles_for_sm90(pdl):
    """kernels/decode_qkv_attention.py: the row GEMV's programs (the norm, the bias) and the group's last program's
    attention (the counter's atomic add); launched early, the weight loads come before the wait."""
    from paratron.kernels import decode_qkv_attention as dqa
    from paratron.kernels import gemv_row
    if not hasattr(dqa, "_qkv_attention_kernel"):
        pytest.skip("paratron's kernels module did not see Triton")
    types = {"x_ptr": "*bf16", "w_ptr": "*bf16", "g_ptr": "*bf16", "b_ptr": "*bf16", "qkv_ptr": "*bf16",
             "cos_ptr": "*fp32", "sin_ptr": "*fp32", "k_ptr": "*bf16", "v_ptr": "*bf16", "pad_ptr": "*i64",
             "slot_ptr": "*i64", "out_ptr": "*bf16", "count_ptr": "*i32", "eps": "fp32", "scale": "fp32",
             "qn_ptr": "*bf16", "kn_ptr": "*bf16", "qk_eps": "fp32"}
    aligned = ("x_ptr", "w_ptr", "g_ptr", "qkv_ptr", "N", "K")
    shape = gemv_row.early_config(3072, 2048) if pdl else {"BLOCK_K": 1024, "num_warps": 4, "AHEAD": 1, "POLICY": ""}
    warps = shape.pop("num_warps")
    for norm, bias, qk in ((True, False, False), (True, True, True)):
        ptx = compile_sm90(dqa._qkv_attention_kernel, types,
                           {**shape, "BLOCK_N": dqa.BLOCK_N, "NORM": norm, "HAS_BIAS": bias, "PDL": pdl, "QPG": 4,
                            "QB": 16, "D": 64, "BT": 64, "QK_NORM": qk}, aligned, warps).asm["ptx"]
        assert ("griddepcontrol.wait" in ptx) == pdl and "atom" in ptx and "ld.global.v4.b32" in ptx
        if pdl:
            assert ptx.index("ld.global") < ptx.index("griddepcontrol.wait")


@pytest.mark.parametrize("split,gated", [(1, False), (4, False), (2, True)])
def test_decode_gemv_kernel_compiles_for_sm90(split, gated):
    """kernels/gemv.py: plain and split K (atomics, the counter), fc1's fused SwiGLU, with bias and residual."""
    from paratron.kernels import gemv
    if not hasattr(gemv, "_gemv_kernel"):
        pytest.skip("paratron's kernels module did not see Triton")
    types = {"x_ptr": "*bf16", "w_ptr": "*bf16", "b_ptr": "*bf16", "r_ptr": "*bf16", "out_ptr": "*bf16",
             "ws_ptr": "*fp32", "cnt_ptr": "*i32"}
    for config in (gemv.CONFIGS[0], gemv.CONFIGS[-1]):
        out = compile_sm90(gemv._gemv_kernel, types, dict(HAS_BIAS=True, HAS_RES=not gated, GATED=gated,
                                                          SPLIT_K=split, BLOCK_M=gemv.BLOCK_M, **config.kwargs))
        assert "cubin" in out.asm and len(out.asm["cubin"]) > 0


@pytest.mark.parametrize("pdl", [False, True])
def test_row_gemv_kernel_compiles_for_sm90(pdl):
    """kernels/gemv_row.py with its norm, SwiGLU and residual, every block shape of its tuning list; with programmatic
    dependent launch, the wait comes after the first weight loads."""
    from paratron.kernels import gemv_row
    if not hasattr(gemv_row, "_row_kernel"):
        pytest.skip("paratron's kernels module did not see Triton")
    types = {"x_ptr": "*bf16", "w_ptr": "*bf16", "g_ptr": "*bf16", "r_ptr": "*bf16", "b_ptr": "*bf16", "out_ptr": "*bf16",
             "eps": "fp32"}
    aligned = ("x_ptr", "w_ptr", "g_ptr", "r_ptr", "out_ptr", "N", "K")  # llama-1b's sizes: the weights in 16 bytes
    for i, config in enumerate(gemv_row.CONFIGS):
        flags = dict(NORM=i % 2 == 0, HAS_RES=i % 3 == 0, GATED=i % 2 == 1, PDL=pdl, HAS_BIAS=i % 4 == 0)
        ptx = compile_sm90(gemv_row._row_kernel, types, {**flags, **config.kwargs, "AHEAD": 1, "POLICY": ""},
                           aligned, config.num_warps).asm["ptx"]
        assert ("griddepcontrol.wait" in ptx) == pdl
        assert "ld.global.v4.b32" in ptx
        if pdl:
            assert ptx.index("ld.global") < ptx.index("griddepcontrol.wait")
    if pdl:  # early_config's: two blocks ahead requested before the wait, the weights' loads hinted evict_first
        early = gemv_row.early_config(2048, 8192)
        warps = early.pop("num_warps")
        for gated in (False, True):
            flags = dict(NORM=gated, HAS_RES=not gated, GATED=gated, PDL=True, HAS_BIAS=False)

            def loads_before_wait(**depth):
                ptx = compile_sm90(gemv_row._row_kernel, types, {**flags, **early, **depth}, aligned, warps).asm["ptx"]
                before = ptx[:ptx.index("griddepcontrol.wait")]
                return before.count("ld.global"), before.count("evict_first")
            (two, hinted), (one, plain) = loads_before_wait(), loads_before_wait(AHEAD=1, POLICY="")
            assert two == 2 * one and hinted >= two and plain == 0  # (a policy register counts too)


@pytest.mark.parametrize("act", [0, 3])
def test_fp8_cast_kernels_compile_for_sm90(act):
    """kernels/fp8_cast.py's amax and cast passes (SwiGLU, and the plain cast): each program's maximum goes to the
    amax by one atomic max of its bits, and the cast pass divides as torch does (rounded to nearest)."""
    from paratron.kernels import fp8_cast as fc
    if not hasattr(fc, "_act_cast"):
        pytest.skip("paratron's kernels module did not see Triton")
    types = {"h_ptr": "*bf16", "b_ptr": "*bf16", "d_ptr": "*bf16", "preset_ptr": "*fp32", "amax_ptr": "*i32",
             "scale_ptr": "*fp32", "q_ptr": "*fp8e4nv", "qt_ptr": "*fp8e4nv", "db_ptr": "*fp32"}
    bm, bf, warps = fc.TILES[0]
    flags = dict(ACT=act, GATED=act == fc.SWIGLU, HAS_BIAS=False, RCP=True, BM=bm, BF=bf)
    for kernel, cast in ((fc._act_amax, False), (fc._act_cast, True), (fc._grad_amax, False), (fc._grad_cast, True)):
        extra = dict(FMAX=448.0, MULT=1.0) if cast else {}
        ptx = compile_sm90(kernel.fn, types, {**flags, **extra}, num_warps=warps).asm["ptx"]
        assert ".max.s32" in ptx and ("atom" in ptx or "red" in ptx)
        assert ("div.rn.f32" in ptx) == cast
