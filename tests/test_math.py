"""kernels/_math.py: the fp32 activations of the GEMM and bias_gelu epilogues (GELU through the normal CDF's Mills
ratio polynomial, tanh-GELU as a sigmoid, QuickGELU) and their derivatives, on a dense grid against float64.

The bounds are max abs errors a little above what libdevice's erff-based GELU reaches in fp32 (GELU 4.5e-7,
GELU' 1.3e-7 on [-12, 12]); on a GPU the exp2 is the approximate one (2 ulp), which the margin covers.
"""
from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from tests.numerics import DEVICE, assert_close
from vit_fast.kernels._math import ACTIVATIONS, act_fwd_bwd, normal_cdf_pdf
from vit_fast.kernels._utils import check_kernel_device

BLOCK = 4096


@triton.jit
def _activation_kernel(Y, DY, U, n, ACT: tl.constexpr, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    ok = offs < n
    y, dy = act_fwd_bwd(tl.load(U + offs, mask=ok, other=0.0), ACT)
    tl.store(Y + offs, y, mask=ok)
    tl.store(DY + offs, dy, mask=ok)


@triton.jit
def _normal_kernel(CDF, PDF, U, n, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    ok = offs < n
    cdf, pdf = normal_cdf_pdf(tl.load(U + offs, mask=ok, other=0.0))
    tl.store(CDF + offs, cdf, mask=ok)
    tl.store(PDF + offs, pdf, mask=ok)


def _grid_points() -> torch.Tensor:
    """Dense over [-12, 12] (GELU's transition and both tails, past the polynomial's clamp at 6), plus the
    neighbours of 0 and of the clamp."""
    u = torch.linspace(-12.0, 12.0, 2 ** 17 + 1, dtype=torch.float32)
    edges = torch.tensor([0.0, -0.0, 1e-30, -1e-30, 1e-7, -1e-7, 6.0, -6.0, 5.9999995, -5.9999995, 6.0000005],
                         dtype=torch.float32)
    return torch.cat([u, edges]).to(DEVICE)


def _run(kernel, u: torch.Tensor, **constexprs) -> tuple[torch.Tensor, torch.Tensor]:
    check_kernel_device("test_math", u)
    a, b = torch.full_like(u, float("nan")), torch.full_like(u, float("nan"))
    kernel[(triton.cdiv(u.numel(), BLOCK),)](a, b, u, u.numel(), BLOCK=BLOCK, **constexprs)
    return a, b


def _gelu64(u: torch.Tensor, activation: str) -> tuple[torch.Tensor, torch.Tensor]:
    u = u.double().cpu()
    if activation == "gelu":
        cdf = 0.5 * torch.erfc(-u / math.sqrt(2.0))
        return u * cdf, cdf + u * torch.exp(-0.5 * u * u) / math.sqrt(2 * math.pi)
    if activation == "gelu_tanh":
        k = math.sqrt(2 / math.pi)
        t = torch.tanh(k * (u + 0.044715 * u ** 3))
        return 0.5 * u * (1 + t), 0.5 * (1 + t) + 0.5 * u * (1 - t * t) * k * (1 + 3 * 0.044715 * u * u)
    s = torch.sigmoid(1.702 * u)
    return u * s, s + 1.702 * u * s * (1 - s)


# (activation, max abs error of act, of act'): erff-based fp32 GELU reaches 4.5e-7 / 1.3e-7 (these 4.1e-7 / 1.4e-7);
# the tanh form from tanh 4.3e-7 / 2.0e-6 (these 5.1e-7 / 2.0e-6: act' holds a cancelling 1 - s, as the tanh form's
# 1 - tanh^2); QuickGELU 7.4e-7 / 9.8e-7
BOUNDS = {"gelu": (6e-7, 2.5e-7), "gelu_tanh": (8e-7, 3e-6), "quick_gelu": (1e-6, 1.5e-6)}


@pytest.mark.parametrize("activation", list(ACTIVATIONS))
def test_activation_and_derivative_against_float64(activation):
    u = _grid_points()
    y, dy = _run(_activation_kernel, u, ACT=ACTIVATIONS[activation])
    y64, dy64 = _gelu64(u, activation)
    y_bound, dy_bound = BOUNDS[activation]
    y_err = (y.double().cpu() - y64).abs().max().item()
    dy_err = (dy.double().cpu() - dy64).abs().max().item()
    assert y_err <= y_bound, f"{activation}: max abs error {y_err:.3e} > {y_bound:.1e}"
    assert dy_err <= dy_bound, f"{activation}': max abs error {dy_err:.3e} > {dy_bound:.1e}"


def test_normal_cdf_and_density():
    """Phi within 1.5e-7 absolute everywhere (the tail polynomial's 1.7e-8 plus fp32 rounding), monotone
    non-decreasing over the grid (no seam where the clamp takes over), 0.5 at 0 to fp32 rounding, and the density
    within 1e-7 absolute (its exponent u^2 / 2 is rounded to fp32: a relative error growing with u^2)."""
    u = _grid_points()
    cdf, pdf = _run(_normal_kernel, u)
    u64 = u.double().cpu()
    cdf64 = 0.5 * torch.erfc(-u64 / math.sqrt(2.0))
    pdf64 = torch.exp(-0.5 * u64 * u64) / math.sqrt(2 * math.pi)
    cdf, pdf = cdf.double().cpu(), pdf.double().cpu()
    assert (cdf - cdf64).abs().max().item() <= 1.5e-7
    assert (pdf - pdf64).abs().max().item() <= 1e-7
    order = torch.argsort(u64[: 2 ** 17 + 1])
    assert (cdf[order].diff() >= 0).all(), "Phi decreases somewhere on the grid"
    assert abs(cdf[u64 == 0].max().item() - 0.5) <= 6e-8


@pytest.mark.parametrize("activation", list(ACTIVATIONS))
def test_non_finite_and_huge_inputs_as_eager_torch(activation):
    """NaN, +-inf and huge finite inputs: the values and NaN pattern of eager torch's fp32 GELU forward and
    backward (tanh-GELU's derivative is NaN at +-1e20 there too: u (1 - t^2) is inf x 0), and of the float64
    formula for QuickGELU."""
    u = torch.tensor([float("nan"), float("inf"), -float("inf"), 30.0, -30.0, 1e20, -1e20], device=DEVICE)
    y, dy = _run(_activation_kernel, u, ACT=ACTIVATIONS[activation])
    if activation == "quick_gelu":
        y_ref, dy_ref = _gelu64(u, activation)
    else:
        x = u.detach().cpu().requires_grad_()
        y_ref = F.gelu(x, approximate="tanh" if activation == "gelu_tanh" else "none")
        y_ref.sum().backward()
        y_ref, dy_ref = y_ref.detach(), x.grad
    assert_close(y, y_ref, 1e-6, activation)
    assert_close(dy, dy_ref, 1e-6, activation + "'")
