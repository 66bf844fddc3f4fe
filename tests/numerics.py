"""Numerical comparison helpers and the device / dtype lists shared by the tests (fixtures: conftest.py).

Every kernel output is compared with a float64 reference: relative error ||out - ref|| / ||ref||
and max abs error, against per-dtype bounds (vit_fast/tools/numerics.py, the one source of truth).
NaN passes only where the reference is NaN.
"""
from __future__ import annotations

import torch

from vit_fast._compat import monkeypatch_setting  # torch settings served by __getattr__
from vit_fast.kernels.bias_gelu import bias_dropout_add
from vit_fast.tools.numerics import bound, errors

__all__ = ["DEVICE", "DTYPES", "assert_close", "bound", "check_compiled_dropout", "check_matches_reference",
           "dtype_id", "errors", "kernel_keep_mask", "randn", "strided_and_expanded"]

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
DTYPES = [torch.float32, torch.float16, torch.bfloat16]


def dtype_id(value) -> str | None:
    """pytest id of a dtype parameter ('float32', ...); None (pytest's own) for anything else."""
    return str(value).replace("torch.", "") if isinstance(value, torch.dtype) else None


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


def check_matches_reference(fn, ref_fn, inputs: dict, dtype: torch.dtype, grad_outputs=None, eager_fn=None, seed=None):
    """Run fn on `inputs` (tensors with requires_grad get gradients) and ref_fn on float64 copies;
    compare every output and every gradient against the float64 result with the dtype's bound.
    With eager_fn, also hold the flash-attention rule: kernel error <= 2x the error of eager PyTorch
    on the same low-precision inputs (+1e-6). `seed` reseeds torch before each call (same dropout)."""
    def run(f, ins, outs_grads):
        if seed is not None:
            torch.manual_seed(seed)
        outs = f(**ins)
        outs = outs if isinstance(outs, tuple) else (outs,)
        leaves = [t for t in ins.values() if isinstance(t, torch.Tensor) and t.requires_grad]
        if outs_grads is None:
            outs_grads = [torch.randn_like(o, dtype=torch.float64) for o in outs]
        grads = torch.autograd.grad(outs, leaves, [g.to(o.dtype) for o, g in zip(outs, outs_grads)]) if leaves else ()
        return outs, grads, outs_grads

    def detached(dt):
        return {k: (v.detach().to(dt).requires_grad_(v.requires_grad) if isinstance(v, torch.Tensor)
                    and v.is_floating_point() else v) for k, v in inputs.items()}

    outs64, grads64, gouts = run(ref_fn, detached(torch.float64), grad_outputs)
    outs, grads, _ = run(fn, inputs, gouts)
    names = [f"out{i}" for i in range(len(outs))] + [
        f"d{k}" for k, v in inputs.items() if isinstance(v, torch.Tensor) and v.requires_grad]
    results = list(zip(names, list(outs) + list(grads), list(outs64) + list(grads64)))
    for name, got, want in results:
        assert_close(got, want, bound(dtype), name)  # inputs and grads enter in dtype
    if eager_fn is not None and dtype != torch.float32:
        eager_outs, eager_grads, _ = run(eager_fn, {k: v for k, v in inputs.items()}, gouts)
        for (name, got, want), eager in zip(results, list(eager_outs) + list(eager_grads)):
            kernel_err, eager_err = errors(got, want)[0], errors(eager, want)[0]
            assert kernel_err <= 2 * eager_err + 1e-6, f"{name}: {kernel_err:.2e} > 2x eager {eager_err:.2e}"
    return outs, grads


def randn(*shape, dtype=torch.float32, grad=True, scale=1.0):
    return (torch.randn(*shape, device=DEVICE, dtype=torch.float32) * scale).to(dtype).requires_grad_(grad)


def kernel_keep_mask(shape, p, seed, dtype=torch.float32):
    """The kernel's own dropout mask for `seed`: x = 1, no bias, residual = 0 leaves 1/(1-p) or 0."""
    torch.manual_seed(seed)
    ones = torch.ones(shape, device=DEVICE, dtype=dtype)
    return bias_dropout_add(ones, None, torch.zeros_like(ones), p, True) != 0


def check_compiled_dropout(fn, inputs: list[torch.Tensor], monkeypatch) -> None:
    """fn draws dropout in training: torch.compile must trace it whole without capture_scalar_outputs
    (the seed is a tensor drawn in the graph, read as an int only inside the custom ops), draw a
    fresh mask on every call, and for the same torch.manual_seed give eager's output and gradients."""
    monkeypatch_setting(monkeypatch, torch._dynamo.config, "capture_scalar_outputs", False)
    torch._dynamo.reset()
    explained = torch._dynamo.explain(fn)(*inputs)
    assert (explained.graph_count, explained.graph_break_count) == (1, 0), explained.break_reasons
    compiled = torch.compile(fn, fullgraph=True, backend="aot_eager")
    results = []
    for run in (compiled, compiled, fn):
        for t in inputs:
            t.grad = None
        torch.manual_seed(3)
        out = run(*inputs)
        grad_out = torch.randn(out.shape, generator=torch.Generator().manual_seed(1), device="cpu").to(out)
        out.backward(grad_out)  # the backward regenerates the mask from the saved seed tensor
        results.append([out.detach()] + [t.grad for t in inputs])
        with torch.no_grad():
            assert not torch.equal(run(*inputs), out), "the next call must draw another mask"
    for got in results[1:]:
        assert all(torch.equal(a, b) for a, b in zip(got, results[0])), "same manual_seed, different draw"


def strided_and_expanded(n: int):
    """A stride-2 view and a stride-0 (expanded) view of length n: parameters the kernels index as
    ptr + col must be copied first (unit_stride), or they read the wrong elements / out of bounds."""
    strided = randn(2 * n, grad=False)[::2].requires_grad_()
    expanded = randn(1, grad=False, scale=0.7).requires_grad_().expand(n)
    return strided, expanded
