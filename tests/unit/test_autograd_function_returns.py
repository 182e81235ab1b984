"""No autograd Function in paratron returns from its forward a call that may hand back its own operand unchanged
(``t.to(dtype)``, ``t.contiguous()``, ``t.float()``, ... when nothing needs converting): torch 2.11 traced such a
forward with a zero output gradient under torch.compile (docs/moe.md: the blockwise MoE step that did not learn;
kernels/fp8_grouped.py's ``_cast`` returns the tensor itself instead). The check reads the source: every
``return`` of a ``forward`` in a class derived from ``...Function``. It sees the direct form only; a helper
returning such a call (as the grouped GEMMs did) is caught by the compiled-gradient tests
(tests/unit/test_fp8_experts.py, tests/unit/test_moe_dispatch.py) when they run under torch 2.11."""
import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
MAY_RETURN_SELF = {"to", "contiguous", "type", "type_as", "float", "bfloat16", "half", "double", "cuda", "cpu"}


def offending_returns(source: str) -> list[str]:
    """``Class.forward: expression`` for each return of a Function's forward that calls one of MAY_RETURN_SELF."""
    out = []
    for cls in (n for n in ast.walk(ast.parse(source)) if isinstance(n, ast.ClassDef)):
        if not any(ast.unparse(b).endswith("Function") for b in cls.bases):
            continue
        for fn in (f for f in cls.body if isinstance(f, ast.FunctionDef) and f.name == "forward"):
            for r in (n for n in ast.walk(fn) if isinstance(n, ast.Return) and n.value is not None):
                for v in (r.value.elts if isinstance(r.value, ast.Tuple) else [r.value]):
                    if isinstance(v, ast.Call) and isinstance(v.func, ast.Attribute) and v.func.attr in MAY_RETURN_SELF:
                        out.append(f"{cls.name}.forward: {ast.unparse(v)}")
    return out


def test_the_check_finds_a_forward_returning_a_cast():
    src = ("class F(torch.autograd.Function):\n    @staticmethod\n    def forward(ctx, x):\n"
           "        y = x * 2\n        return y.to(x.dtype), y\n")
    assert offending_returns(src) == ["F.forward: y.to(x.dtype)"]
    assert offending_returns(src.replace("y.to(x.dtype)", "_cast(y, x.dtype)")) == []


def test_no_autograd_function_forward_returns_a_maybe_no_op_cast():
    found = {str(p.relative_to(ROOT)): offending_returns(p.read_text(encoding="utf-8"))
             for p in sorted((ROOT / "paratron").rglob("*.py"))}
    assert not {k: v for k, v in found.items() if v}, found
