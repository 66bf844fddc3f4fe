"""Constants and @triton.jit math shared by the kernel families: one source for log2(e), ln 2 and
the GELU constants, the normal CDF and density, the GELU value/derivative pair (bias_gelu's and linear_act's
epilogues) and linear_act's activations (GELU, tanh-GELU, QuickGELU) with their derivatives.

Jit globals must be ``tl.constexpr``; in the interpreter a constexpr must be the right-hand operand
(``tensor * CONST``), so every use below keeps the tensor first.
"""
from __future__ import annotations

import triton
import triton.language as tl

LOG2E = tl.constexpr(1.4426950408889634)  # softmax in base 2: exp(x) = exp2(x * log2(e))
LN2 = tl.constexpr(0.6931471805599453)  # back to natural log: log(x) = log2(x) * ln 2


# tanh-GELU's sigmoid(2 z) = 1 / (1 + exp2(h (h^2 CUBIC + LINEAR))) and the derivative of 2 z (base-2 constants
# folded: LINEAR = -2 sqrt(2/pi) log2(e), CUBIC = 0.044715 LINEAR; d(2z)/dh = DLINEAR + 3 x 0.044715 DLINEAR h^2)
TANH_GELU_LINEAR = tl.constexpr(-2.302208198144325)
TANH_GELU_CUBIC = tl.constexpr(-0.1029432395800235)
TANH_GELU_DLINEAR = tl.constexpr(1.5957691216057308)
TANH_GELU_DCUBIC = tl.constexpr(0.21406444881780073)


# Mills ratio R(a) = (1 - Phi(a)) / phi(a) for a in [0, 5] (Phi, phi: the standard normal CDF and density) as a
# degree-11 polynomial in t = a - 5/2 (centred, Horner's rule is well conditioned: Phi stays monotone at fp32
# resolution), fitted weighted by phi(a) + 1e-5 with each coefficient rounded to fp32 before the rest were fitted
# again: the tail 1 - Phi = phi R within 2.1e-8, R within 0.92% (positive) up to a = 5, where R(5) serves all larger
# a (the tail is 3e-7 there and its error shrinks with phi). In fp32 with FMAs, on [-12, 12]: Phi within 1.2e-7 of
# float64, GELU 4.2e-7, GELU' 1.2e-7 (with a GPU's exp2, 2 ulp: 2.3e-7 and 2.4e-7), where libdevice's erff gives
# 6e-8, 4.5e-7, 1.3e-7; at half the instructions (sm_90: 21 per element for GELU and GELU' against 42): erff selects
# its polynomial's coefficients per element between two ranges and pays an exp of its own, here the density's exp
# serves both.
MILLS_A_MAX = tl.constexpr(5.0)
MILLS_T_SHIFT = tl.constexpr(2.5)  # t = a - MILLS_T_SHIFT
MILLS0 = tl.constexpr(0.35426396131515503)
MILLS1 = tl.constexpr(-0.11433939635753632)
MILLS2 = tl.constexpr(0.034228261560201645)
MILLS3 = tl.constexpr(-0.009563869796693325)
MILLS4 = tl.constexpr(0.002546139294281602)
MILLS5 = tl.constexpr(-0.0007074724999256432)
MILLS6 = tl.constexpr(0.0001208042522193864)
MILLS7 = tl.constexpr(-2.0073312043678015e-05)
MILLS8 = tl.constexpr(2.714778747758828e-05)
MILLS9 = tl.constexpr(6.353143930937222e-07)
MILLS10 = tl.constexpr(-1.7184225953315035e-06)
MILLS11 = tl.constexpr(-7.102761969690619e-07)
NEG_HALF_LOG2E = tl.constexpr(-0.7213475204444817)  # phi(u) = exp2(u * u * NEG_HALF_LOG2E + LOG2_INV_SQRT_2PI)
LOG2_INV_SQRT_2PI = tl.constexpr(-1.3257480647361592)


@triton.jit
def normal_cdf_pdf(u):
    """(Phi(u), phi(u)) in fp32 (see MILLS0): Phi = 1 - phi R(|u|) for u >= 0, phi R(|u|) below."""
    pdf = tl.exp2(u * u * NEG_HALF_LOG2E + LOG2_INV_SQRT_2PI)
    t = tl.minimum(tl.abs(u), MILLS_A_MAX) - MILLS_T_SHIFT  # NaN stays NaN through pdf
    r = t * MILLS11 + MILLS10
    r = r * t + MILLS9
    r = r * t + MILLS8
    r = r * t + MILLS7
    r = r * t + MILLS6
    r = r * t + MILLS5
    r = r * t + MILLS4
    r = r * t + MILLS3
    r = r * t + MILLS2
    r = r * t + MILLS1
    r = r * t + MILLS0
    tail = pdf * r
    return tl.where(u >= 0, 1.0 - tail, tail), pdf


@triton.jit
def gelu_fwd_bwd(h, APPROX_TANH: tl.constexpr):
    """(GELU(h), GELU'(h)) in fp32; exact erf form, or the tanh approximation with APPROX_TANH."""
    if APPROX_TANH:
        # 0.5 (1 + tanh(z)) = sigmoid(2 z), z = sqrt(2/pi) (h + 0.044715 h^3): one exp and one division. s (1 - s)
        # cancels where s nears 1 (GELU' within 2.0e-6, as the tanh form's 1 - tanh^2); its exact form e s keeps e
        # live, which spills the 128x256 TMA forward 64 B under triton 3.6
        h2 = h * h
        s = 1.0 / (1.0 + tl.exp2(h * (h2 * TANH_GELU_CUBIC + TANH_GELU_LINEAR)))
        y = h * s
        dy = s + h * (s * (1.0 - s)) * (h2 * TANH_GELU_DCUBIC + TANH_GELU_DLINEAR)
    else:
        cdf, pdf = normal_cdf_pdf(h)
        y = h * cdf
        dy = cdf + h * pdf
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
