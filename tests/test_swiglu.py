"""kernels/swiglu.py: SiLU(a) * b (separate and packed halves) against float64 references, forward and every
gradient, NaN-poisoned outputs, strided inputs, determinism, torch.compile and bad input."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from tests.numerics import assert_close, bound
from vit_fast.kernels.swiglu import swiglu, swiglu_packed, swiglu_packed_ref, swiglu_ref

DTYPES = [torch.float32, torch.float16, torch.bfloat16]
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


@pytest.fixture(autouse=True)
def poisoned_outputs(monkeypatch):
    """Every torch.empty comes back NaN-filled: an output element a kernel forgets to write fails."""
    real_empty = torch.empty

    def nan_empty(*args, **kwargs):
        t = real_empty(*args, **kwargs)
        return t.fill_(float("nan")) if t.is_floating_point() else t

    monkeypatch.setattr(torch, "empty", nan_empty)


def _ref64(a, b, dy):
    a64, b64 = a.detach().double().requires_grad_(), b.detach().double().requires_grad_()
    y = F.silu(a64) * b64
    y.backward(dy.double())
    return y, a64.grad, b64.grad


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", [(2, 5, 72), (3, 37), (1, 300), (4, 1)])
def test_swiglu_matches_float64(dtype, shape):
    torch.manual_seed(0)
    a = (torch.randn(shape, device=DEVICE) * 3).to(dtype).requires_grad_()
    b = torch.randn(shape, device=DEVICE).to(dtype).requires_grad_()
    dy = torch.randn(shape, device=DEVICE).to(dtype)
    y = swiglu(a, b)
    y.backward(dy)
    ref, da, db = _ref64(a, b, dy)
    tol = bound(dtype)
    assert y.dtype == dtype and a.grad.dtype == dtype
    assert_close(y, ref, tol, "y")
    assert_close(a.grad, da, tol, "da")
    assert_close(b.grad, db, tol, "db")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("gate_last", [False, True])
def test_swiglu_packed_matches_float64_and_timm_glu(dtype, gate_last):
    """Packed (..., 2F) halves read in place; the gradient comes back packed in one buffer; same halves
    as timm's GluMlp chunk (gate_last=False: SiLU(first) * second)."""
    torch.manual_seed(1)
    h = (torch.randn(2, 7, 2 * 40, device=DEVICE) * 2).to(dtype).requires_grad_()
    dy = torch.randn(2, 7, 40, device=DEVICE).to(dtype)
    y = swiglu_packed(h, gate_last)
    y.sum().backward()  # stride-0 incoming gradient first
    g_sum = h.grad.clone()
    h.grad = None
    y = swiglu_packed(h, gate_last)
    y.backward(dy)
    h64 = h.detach().double().requires_grad_()
    x1, x2 = h64.chunk(2, dim=-1)
    ref = x1 * F.silu(x2) if gate_last else F.silu(x1) * x2
    ref.backward(dy.double())
    tol = bound(dtype)
    assert_close(y, ref, tol, "y")
    assert_close(h.grad, h64.grad, tol, "dh")
    h64 = h.detach().double().requires_grad_()
    x1, x2 = h64.chunk(2, dim=-1)
    (x1 * F.silu(x2) if gate_last else F.silu(x1) * x2).sum().backward()
    assert_close(g_sum, h64.grad, tol, "dh (sum-driven backward)")
    assert_close(swiglu_packed_ref(h, gate_last), ref, tol, "reference")


def test_swiglu_strided_inputs_and_determinism():
    """Non-contiguous rows (a slice of a wider tensor) and a transposed (strided-column) value; two backward
    passes are bitwise equal."""
    torch.manual_seed(2)
    base = torch.randn(6, 100, device=DEVICE)
    a = base[:, 10:50].requires_grad_()
    wide = torch.randn(6, 90, device=DEVICE)
    b_src = torch.randn(40, 6, device=DEVICE).requires_grad_()
    b = b_src.t()  # column stride 6: copied once by the launcher
    dy = torch.randn(6, 40, device=DEVICE)
    grads = []
    for _ in range(2):
        a.grad = b_src.grad = None
        y = swiglu(a, b)
        y.backward(dy)
        grads.append((a.grad.clone(), b_src.grad.clone()))
    ref, da, db = _ref64(a, b, dy)
    assert_close(y, ref, bound(torch.float32), "y")
    assert_close(grads[0][0], da, bound(torch.float32), "da")
    assert_close(grads[0][1], db.t(), bound(torch.float32), "db")
    assert all(torch.equal(x, y) for x, y in zip(grads[0], grads[1]))
    row_strided = wide[:, 5:45]
    assert_close(swiglu(row_strided, row_strided), swiglu_ref(row_strided.double(), row_strided.double()),
                 bound(torch.float32), "row-strided")


def test_swiglu_extremes_and_empty():
    """Large |a| saturates the sigmoid without inf/NaN; zero rows return empty tensors."""
    a = torch.tensor([[-100.0, -30.0, 0.0, 30.0, 100.0]], device=DEVICE, requires_grad=True)
    b = torch.ones_like(a).requires_grad_()
    y = swiglu(a, b)
    y.sum().backward()
    ref, da, db = _ref64(a, b, torch.ones_like(a))
    assert_close(y, ref, 1e-6, "y", atol=1e-5)
    assert_close(a.grad, da, 1e-6, "da", atol=1e-5)
    empty = torch.zeros(0, 8, device=DEVICE, requires_grad=True)
    out = swiglu_packed(empty)
    out.sum().backward()
    assert out.shape == (0, 4) and empty.grad.shape == (0, 8)


def test_swiglu_bad_input():
    x = torch.randn(3, 8, device=DEVICE)
    with pytest.raises(ValueError, match="even last dim"):
        swiglu_packed(torch.randn(3, 7, device=DEVICE))
    with pytest.raises(ValueError, match="one shape and dtype"):
        swiglu(x, x[:, :4])
    with pytest.raises(ValueError, match="one shape and dtype"):
        swiglu(x, x.half())
    with pytest.raises(ValueError, match="dtype"):
        swiglu(x.long(), x.long())


def test_swiglu_compiles_fullgraph():
    torch.manual_seed(3)
    h = torch.randn(2, 3, 16, device=DEVICE, requires_grad=True)
    fn = torch.compile(lambda t: swiglu_packed(t).square().sum(), backend="aot_eager", fullgraph=True)
    fn(h).backward()
    g = h.grad.clone()
    h.grad = None
    swiglu_packed_ref(h).square().sum().backward()
    assert_close(g, h.grad, bound(torch.float32), "compiled dh")
