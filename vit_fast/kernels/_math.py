"""Constants and @triton.jit math shared by the kernel families: one source for log2(e), ln 2 and
the GELU constants, the GELU value/derivative pair (bias_gelu's and linear_act's epilogues) and linear_act's
activations (GELU, tanh-GELU, QuickGELU) with their derivatives.

Jit globals must be ``tl.constexpr``; in the interpreter a constexpr must be the right-hand operand
(``tensor * CONST``), so every use below keeps the tensor first.
"""
from __future__ import annotations

import triton
import triton.language as tl

LOG2E = tl.constexpr(1.4426950408889634)  # softmax in base 2: exp(x) = exp2(x * log2(e))
LN2 = tl.constexpr(0.6931471805599453)  # back to natural log: log(x) = log2(x) * ln 2
SQRT1_2 = tl.constexpr(0.7071067811865476)
SQRT_2_OVER_PI = tl.constexpr(0.7978845608028654)
INV_SQRT_2PI = tl.constexpr(0.3989422804014327)


@triton.jit
def tanh(u):
    # tanh from exp (saturates to +-1 without overflow trouble: exp(+inf) -> 1 - 0)
    return 1.0 - 2.0 / (tl.exp(2.0 * u) + 1.0)


@triton.jit
def gelu_fwd_bwd(h, APPROX_TANH: tl.constexpr):
    """(GELU(h), GELU'(h)) in fp32; exact erf form, or the tanh approximation with APPROX_TANH."""
    if APPROX_TANH:
        t = tanh((h + 0.044715 * h * h * h) * SQRT_2_OVER_PI)  # tensor first: constexpr * tensor breaks the interpreter
        y = 0.5 * h * (1.0 + t)
        dy = 0.5 * (1.0 + t) + 0.5 * h * (1.0 - t * t) * SQRT_2_OVER_PI * (1.0 + 3.0 * 0.044715 * h * h)
    else:
        cdf = 0.5 * (1.0 + tl.math.erf(h * SQRT1_2))
        y = h * cdf
        dy = cdf + h * tl.exp(-0.5 * h * h) * INV_SQRT_2PI
    return y, dy


# activation name -> ACT constexpr of act_fwd_bwd (linear_act's kernels)
ACTIVATIONS = {"gelu": 0, "gelu_tanh": 1, "quick_gelu": 2}


@triton.jit
def act_fwd_bwd(u, ACT: tl.constexpr):
    """(act(u), act'(u)) in fp32 for ACT (ACTIVATIONS); the unused one is dead code after inlining."""
    if ACT == 2:  # QuickGELU
        s = tl.sigmoid(u * 1.702)  # tensor first: constexpr * tensor breaks the interpreter
        return u * s, s + u * 1.702 * s * (1.0 - s)
    else:
        return gelu_fwd_bwd(u, ACT == 1)
