"""kernels/_math.py: the fp32 activations of the GEMM and bias_gelu epilogues (GELU through the normal CDF's Mills
ratio polynomial, tanh-GELU as a sigmoid, QuickGELU) and their derivatives, on a dense grid against float64.

The bounds are max abs errors a little above what these reach in the interpreter, whose exp2 is numpy's (erff-based
fp32 GELU reaches 4.5e-7 in GELU and 1.3e-7 in GELU' on [-12, 12]), plus, on a GPU, what its approximate exp2 adds:
2 ulp (a relative 2.4e-7) of the exp's value, at most 0.5 in Phi and GELU', 0.4 in the density.
"""
from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from tests.numerics import DEVICE
from vit_fast.kernels._math import ACTIVATIONS, MILLS_A_MAX, act_fwd_bwd, normal_cdf_pdf
from vit_fast.kernels._utils import check_kernel_device

BLOCK = 4096
EXP2_SLACK = 2.0 ** -22 if DEVICE == "cuda" else 0.0  # the relative error a GPU's exp2 may add


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


GRID = 2 ** 17 + 1


def _grid_points() -> torch.Tensor:
    """Dense over [-12, 12] (GELU's transition and both tails, past the polynomial's clamp), then the neighbours of
    0 (a subnormal among them) and 32 fp32 steps either side of the clamp at +-MILLS_A_MAX, in increasing order."""
    u = torch.linspace(-12.0, 12.0, GRID, dtype=torch.float32)
    small = torch.tensor([-1e-7, -1e-30, -1e-40, -0.0, 0.0, 1e-40, 1e-30, 1e-7], dtype=torch.float32)
    clamp = torch.tensor(MILLS_A_MAX.value, dtype=torch.float32)
    steps = torch.arange(-32, 33, dtype=torch.float32) * (torch.nextafter(clamp, clamp + 1) - clamp)
    return torch.cat([u, small, -(clamp + steps).flip(0), clamp + steps]).to(DEVICE)


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


# (activation, max abs error of act, of act') in the interpreter: GELU 4.1e-7 / 1.4e-7 (erff-based fp32 4.5e-7 /
# 1.3e-7); tanh-GELU 5.1e-7 / 2.0e-6 and QuickGELU 7.4e-7 / 9.8e-7 (their act' takes s (1 - s), which cancels where s
# nears 1, as the tanh form's 1 - tanh^2)
BOUNDS = {"gelu": (6e-7, 2e-7), "gelu_tanh": (7e-7, 2.5e-6), "quick_gelu": (1e-6, 1.2e-6)}


@pytest.mark.parametrize("activation", list(ACTIVATIONS))
def test_activation_and_derivative_against_float64(activation):
    u = _grid_points()
    y, dy = _run(_activation_kernel, u, ACT=ACTIVATIONS[activation])
    y64, dy64 = _gelu64(u, activation)
    y_bound, dy_bound = BOUNDS[activation]
    dy_bound += 0.5 * EXP2_SLACK
    y_err = (y.double().cpu() - y64).abs().max().item()
    dy_err = (dy.double().cpu() - dy64).abs().max().item()
    assert y_err <= y_bound, f"{activation}: max abs error {y_err:.3e} > {y_bound:.1e}"
    assert dy_err <= dy_bound, f"{activation}': max abs error {dy_err:.3e} > {dy_bound:.1e}"


def test_normal_cdf_and_density():
    """Phi within 1.5e-7 absolute everywhere (the tail polynomial's 2.1e-8 plus fp32 rounding: 1.27e-7 here, where
    numpy rounds every product of the Horner steps and 1 - tail apart; 1.2e-7 with a GPU's FMAs) and inside [0, 1],
    non-decreasing over the grid and across the clamp (no seam where R(MILLS_A_MAX) takes over), 0.5 at 0 to fp32
    rounding, and the density within 5e-8 absolute (its exponent u^2 / 2 is rounded to fp32: a relative error
    growing with u^2)."""
    u = _grid_points()
    cdf, pdf = _run(_normal_kernel, u)
    u64 = u.double().cpu()
    cdf64 = 0.5 * torch.erfc(-u64 / math.sqrt(2.0))
    pdf64 = torch.exp(-0.5 * u64 * u64) / math.sqrt(2 * math.pi)
    cdf, pdf = cdf.double().cpu(), pdf.double().cpu()
    assert (cdf - cdf64).abs().max().item() <= 1.5e-7 + 0.5 * EXP2_SLACK
    assert (pdf - pdf64).abs().max().item() <= 5e-8 + 0.4 * EXP2_SLACK
    assert 0 <= cdf.min().item() and cdf.max().item() <= 1
    for part in (cdf[:GRID], cdf[-130:-65], cdf[-65:]):  # the grid, then each side of the clamp, in increasing u
        assert (part.diff() >= 0).all(), "Phi decreases somewhere"
    assert abs(cdf[u64 == 0].max().item() - 0.5) <= 6e-8


@pytest.mark.parametrize("activation", list(ACTIVATIONS))
def test_non_finite_and_huge_inputs_as_eager_torch(activation):
    """NaN, +-inf and huge finite inputs: the values and NaN pattern of eager torch's GELU forward and backward on
    the kernel's device (what the fused op replaces there; tanh-GELU's derivative is NaN at +-1e20 too: u (1 - t^2)
    is inf x 0), and of the float64 formula for QuickGELU. Eager torch is not one answer here: on an AVX-512 CPU
    its vectorized fp32 GELU gives NaN at +inf where its scalar fp32 path and its float64 GELU give +inf (torch
    2.14, 2026-11-28), so each element must be eager's fp32 value or eager's float64 value on that device."""
    u = torch.tensor([float("nan"), float("inf"), -float("inf"), 30.0, -30.0, 1e20, -1e20], device=DEVICE)
    y, dy = _run(_activation_kernel, u, ACT=ACTIVATIONS[activation])
    if activation == "quick_gelu":
        refs = [_gelu64(u, activation)]
    else:
        refs = []
        for dtype in (torch.float32, torch.float64):
            x = u.detach().to(dtype).requires_grad_()
            y_ref = F.gelu(x, approximate="tanh" if activation == "gelu_tanh" else "none")
            y_ref.sum().backward()
            refs.append((y_ref.detach(), x.grad))
    for i, got in enumerate((y, dy)):
        wants = [ref[i].cpu().double() for ref in refs]
        ok = torch.zeros(u.shape, dtype=torch.bool)
        for want in wants:
            ok |= torch.isclose(got.cpu().double(), want, rtol=1e-6, atol=1e-6, equal_nan=True)
        assert ok.all(), (f"{'GELU' if i == 0 else 'its derivative'}: inputs {u.tolist()}\nkernel {got.tolist()}\n"
                          f"eager {[w.tolist() for w in wants]}")
