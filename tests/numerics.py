"""Numerical comparison helpers shared by the tests (GUIDE.md section 4).

Every kernel output is compared with a float64 reference: relative error ||out - ref|| / ||ref||
and max abs error, against per-dtype bounds. NaN passes only where the reference is NaN.
"""
from __future__ import annotations

import torch

from vit_fast.tools.numerics import BOUNDS, EAGER_SLACK, bound, errors  # noqa: F401  (one source of truth)


def assert_close(out: torch.Tensor, ref: torch.Tensor, rtol: float, name: str = "output", atol: float | None = None):
    """Fail with a readable report unless out matches ref within the relative-norm bound rtol.

    Non-finite values must sit exactly where the reference has them (same NaN / same inf).
    ``atol``, when given, additionally bounds the max abs error.
    """
    assert out.shape == ref.shape, f"{name}: shape {tuple(out.shape)} != reference {tuple(ref.shape)}"
    out64, ref64 = out.detach().double().cpu(), ref.detach().double().cpu()
    ref_nan, out_nan = torch.isnan(ref64), torch.isnan(out64)
    assert torch.equal(ref_nan, out_nan), (
        f"{name}: NaN pattern differs ({int(out_nan.sum())} NaN in output, {int(ref_nan.sum())} in reference)"
    )
    ref_inf = torch.isinf(ref64)
    assert torch.equal(out64[ref_inf], ref64[ref_inf]) and not torch.isinf(out64[~ref_inf]).any(), (
        f"{name}: inf pattern differs from the reference"
    )
    rel, max_abs = errors(out64, ref64)
    assert rel <= rtol, f"{name}: relative error {rel:.3e} > bound {rtol:.1e} (max abs {max_abs:.3e})"
    if atol is not None:
        assert max_abs <= atol, f"{name}: max abs error {max_abs:.3e} > {atol:.1e} (relative {rel:.3e})"


def poison_(t: torch.Tensor) -> torch.Tensor:
    """Fill with NaN so an element the kernel forgets to write fails the comparison."""
    return t.fill_(float("nan"))


def poisoned_empty(*args, **kwargs) -> torch.Tensor:
    return poison_(torch.empty(*args, **kwargs))
