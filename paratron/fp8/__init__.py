"""FP8 training: the formats and scaling recipes (recipe.py), the FP8 linear (linear.py) and the fused FP8 MLP
(mlp.py). The casts themselves are kernels (paratron/kernels/fp8_cast.py)."""
from .linear import (attach, coverage, delayed_states, device_problem, fp8_linear, histories, prime, set_histories,
                     startup_line)
from .recipe import (AMAX_ALGOS, E4M3, E5M2, FMAX, FORMATS, LAYERS, RECIPES, REFUSED_RECIPES, FP8State, Recipe,
                     Scaler, amax, compute_scale, dequantize, quantize, scaled_mm)

__all__ = ["attach", "coverage", "delayed_states", "device_problem", "fp8_linear", "histories", "startup_line", "prime",
           "set_histories",
           "AMAX_ALGOS", "E4M3", "E5M2", "FMAX", "FORMATS", "LAYERS", "RECIPES", "REFUSED_RECIPES", "FP8State",
           "Recipe", "Scaler", "amax", "compute_scale", "dequantize", "quantize", "scaled_mm"]
