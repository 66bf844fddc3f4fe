"""kernels/bias_gelu.py: bias_gelu and bias_dropout_add against float64 references, forward and
backward, plus dropout statistics, launches and bytes per element (interpreter counters, the ``traffic``
fixture of conftest.py). Every launcher allocation is NaN-poisoned (conftest.py's ``poisoned_allocations``).
"""
from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from tests.numerics import (
    DEVICE,
    DTYPES,
    assert_close,
    bound,
    check_compiled_dropout,
    check_matches_reference,
    kernel_keep_mask,
    randn,
    strided_and_expanded,
)
from vit_fast.kernels import bias_gelu as bg
from vit_fast.kernels.bias_gelu import bias_dropout_add, bias_dropout_add_ref, bias_gelu, bias_gelu_ref

pytestmark = pytest.mark.usefixtures("poisoned_allocations")


# --------------------------------------------------------------------------- bias_gelu
def eager_bias_gelu(x, bias, approximate):
    return F.gelu(x + bias.to(x.dtype), approximate=approximate)


@pytest.mark.parametrize("approximate", ["none", "tanh"])
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", [(2, 7, 192), (5, 1408)])
def test_bias_gelu_matches_reference(shape, dtype, approximate):
    torch.manual_seed(0)
    inputs = dict(x=randn(*shape, dtype=dtype, scale=2.0), bias=randn(shape[-1], dtype=dtype), approximate=approximate)
    check_matches_reference(bias_gelu, bias_gelu_ref, inputs, dtype, eager_fn=eager_bias_gelu)


@pytest.mark.parametrize("width", [64, 1000, 3072, 5120, 16384])
def test_bias_gelu_widths_bf16_autocast_bias(width):
    """Awkward and ViT-H widths; bf16 activations with an fp32 bias (autocast) -> fp32 dbias."""
    torch.manual_seed(width)
    x, bias = randn(3, width, dtype=torch.bfloat16, scale=2.0), randn(width)
    _, (dx, dbias) = check_matches_reference(bias_gelu, bias_gelu_ref, dict(x=x, bias=bias), torch.bfloat16)
    assert dx.dtype == torch.bfloat16 and dbias.dtype == torch.float32


@pytest.mark.parametrize("shape", [(0, 256), (1, 256), (2, 3, 4, 320)])
def test_bias_gelu_rows_and_leading_shapes(shape):
    torch.manual_seed(1)
    x, bias = randn(*shape), randn(shape[-1])
    (y,), (dx, dbias) = check_matches_reference(bias_gelu, bias_gelu_ref, dict(x=x, bias=bias), torch.float32)
    assert y.shape == x.shape and dx.shape == x.shape
    if x.numel() == 0:
        assert torch.equal(dbias, torch.zeros_like(dbias))


def test_bias_gelu_without_bias_and_non_contiguous_inputs():
    torch.manual_seed(2)
    base = randn(4, 6, 2 * 384, grad=False)
    x_strided = base[..., ::2].requires_grad_()  # last dim strided: copied once
    x_rows = randn(6, 4, 384, grad=False).transpose(0, 1).requires_grad_()  # leading dims permuted
    x_wide = base[..., :384].requires_grad_()  # row stride 768, columns contiguous: no copy
    for x in (x_strided, x_rows, x_wide):
        check_matches_reference(bias_gelu, bias_gelu_ref, dict(x=x, bias=None), torch.float32)


def test_bias_gelu_sum_backward_and_determinism():
    """.sum() gives a stride-0 grad; 100 rows give several partial rows, summed deterministically."""
    torch.manual_seed(3)
    x, bias = randn(100, 320), randn(320)
    runs = []
    for _ in range(2):
        x.grad = bias.grad = None
        bias_gelu(x, bias).sum().backward()
        runs.append((x.grad.clone(), bias.grad.clone()))
    x64, b64 = x.detach().double().requires_grad_(), bias.detach().double().requires_grad_()
    bias_gelu_ref(x64, b64).sum().backward()
    assert_close(runs[0][0], x64.grad, bound(torch.float32), "dx")
    assert_close(runs[0][1], b64.grad, bound(torch.float32), "dbias")
    assert all(torch.equal(a, b) for a, b in zip(runs[0], runs[1]))


@pytest.mark.parametrize("approximate", ["none", "tanh"])
def test_bias_gelu_nan_inf_propagate_like_torch(approximate):
    x = torch.tensor([[float("inf"), -float("inf"), float("nan"), 0.0, -30.0, 30.0, 1e20, -1e20]])
    y = bias_gelu(x, torch.zeros(8), approximate)
    assert_close(y, F.gelu(x.double(), approximate=approximate), 1e-6, "gelu(nan/inf)")


def test_bias_gelu_bad_input():
    x = torch.randn(4, 64)
    with pytest.raises(ValueError, match="at least 2 dims"):
        bias_gelu(torch.randn(64), torch.randn(64))
    with pytest.raises(ValueError, match=r"bias of shape \(64,\)"):
        bias_gelu(x, torch.randn(65))
    with pytest.raises(ValueError, match="dtype"):
        bias_gelu(torch.ones(4, 64, dtype=torch.int32), torch.randn(64))
    with pytest.raises(ValueError, match="approximate"):
        bias_gelu(x, torch.randn(64), "sigmoid")


def test_bias_gelu_launches_and_bytes(traffic):
    """Forward: 1 launch reading x and writing y once (2s per element). Backward: 2 launches
    (row tiles + partial sums) reading x and dy once and writing dx once (3s per element)."""
    x, bias, dy = torch.randn(40, 768, dtype=torch.bfloat16), torch.randn(768), torch.randn(40, 768,
                                                                                             dtype=torch.bfloat16)
    y = bg.bias_gelu_fwd(x, bias, "none")
    assert traffic.launches == ["_bias_gelu_fwd_kernel"]
    assert traffic.bytes("read", x) == x.nbytes and traffic.bytes("write", y) == y.nbytes
    traffic.clear()
    dx, dbias = bg.bias_gelu_bwd(dy, x, bias, "none")
    assert traffic.launches == ["_bias_gelu_bwd_kernel", "_sum_partials_kernel"]
    assert traffic.bytes("read", x) == x.nbytes and traffic.bytes("read", dy) == dy.nbytes
    assert traffic.bytes("write", dx) == dx.nbytes


# --------------------------------------------------------------------------- bias_dropout_add
def eager_bias_dropout_add(x, bias, residual, p, training, **kw):
    kw = {k: (v.to(x.dtype) if k == "gamma" and v is not None else v) for k, v in kw.items()}
    return bias_dropout_add_ref(x, bias.to(x.dtype) if bias is not None else None, residual, p, training, **kw)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("gamma,drop_path", [(False, False), (True, False), (False, True), (True, True)])
def test_bias_dropout_add_matches_reference(dtype, gamma, drop_path):
    """Eval mode (no draw) with every combination of LayerScale and drop-path scale."""
    torch.manual_seed(4)
    b, n, d = 3, 5, 384
    inputs = dict(x=randn(b, n, d, dtype=dtype), bias=randn(d, dtype=dtype), residual=randn(b, n, d, dtype=dtype),
                  p=0.1, training=False, gamma=randn(d, dtype=dtype, scale=0.1) if gamma else None,
                  sample_scale=torch.tensor([0.0, 1.25, 1.25], device=DEVICE) if drop_path else None)
    check_matches_reference(bias_dropout_add, bias_dropout_add_ref, inputs, dtype, eager_fn=eager_bias_dropout_add)


@pytest.mark.parametrize("dtype", DTYPES)
def test_bias_dropout_add_dropout_mask_forward_and_backward(dtype):
    """Dropout with the kernel's own mask: forward and every gradient against the F.dropout-style
    reference applying that mask (so the backward regenerates the forward's mask)."""
    b, n, d, p, seed = 2, 7, 768, 0.3, 11
    keep = kernel_keep_mask((b, n, d), p, seed, dtype)
    torch.manual_seed(5)
    inputs = dict(x=randn(b, n, d, dtype=dtype), bias=randn(d), residual=randn(b, n, d, dtype=dtype), p=p,
                  training=True, gamma=randn(d, scale=0.1), sample_scale=torch.tensor([2.0, 0.0], device=DEVICE))
    check_matches_reference(bias_dropout_add, lambda **kw: bias_dropout_add_ref(**kw, keep_mask=keep), inputs, dtype,
                            seed=seed)


def test_dropout_rate_seeds_and_eval_mode():
    m, d, p = 32, 2048, 0.2  # 65536 draws: 3 sigma = 0.0047
    keep = kernel_keep_mask((m, d), p, seed=1)
    drop_rate, sigma = 1 - keep.float().mean().item(), math.sqrt(p * (1 - p) / keep.numel())
    assert abs(drop_rate - p) < 3 * sigma, f"drop rate {drop_rate:.4f} not within 3 sigma of {p}"
    assert torch.equal(keep, kernel_keep_mask((m, d), p, seed=1)), "same seed, different mask"
    assert not torch.equal(keep, kernel_keep_mask((m, d), p, seed=2)), "different seeds, same mask"
    # eval mode and p = 0 skip the draw: no seed taken from torch's generator, output exact
    x, bias, res = randn(3, 256, grad=False), randn(256, grad=False), randn(3, 256, grad=False)
    state = torch.get_rng_state()
    for out in (bias_dropout_add(x, bias, res, 0.5, False), bias_dropout_add(x, bias, res, 0.0, True)):
        assert torch.equal(torch.get_rng_state(), state)
        assert_close(out, res.double() + x.double() + bias.double(), bound(torch.float32), "no dropout")
    assert torch.equal(bias_dropout_add(x, bias, res, 1.0, True), res), "p=1 drops everything"


def test_dropout_keeps_non_finite_values_where_it_drops_like_torch():
    """A dropped NaN or inf is multiplied by 0 (NaN), as torch's dropout does: a NaN in the branch is not hidden
    by the mask, forward or backward."""
    b, n, d, p, seed = 2, 3, 256, 0.5, 3
    keep = kernel_keep_mask((b, n, d), p, seed)
    x = randn(b, n, d, grad=False)
    x[..., ::7] = float("nan")
    x[..., 3::7] = float("inf")
    x.requires_grad_(True)
    res = randn(b, n, d, grad=False)
    torch.manual_seed(seed)
    out = bias_dropout_add(x, None, res, p, True)
    expected = res.double() + x.detach().double() * keep.double() / (1 - p)
    assert (~keep[..., ::7]).any() and (~keep[..., 3::7]).any()
    assert torch.equal(out.isnan(), expected.isnan()) and torch.equal(out.isinf(), expected.isinf())
    g = torch.ones_like(out)
    g[..., 1::7] = float("nan")
    out.backward(g)
    assert torch.equal(x.grad.isnan(), (g.double() * keep.double()).isnan())


def test_bias_dropout_add_autocast_dtypes_and_plain_backward():
    """bf16 branch into an fp32 residual stream: fp32 output, bf16 dx, fp32 param grads; and the
    plain join (no dropout/gamma/scale) returns dout itself as dx (no dx write)."""
    torch.manual_seed(6)
    inputs = dict(x=randn(2, 3, 192, dtype=torch.bfloat16), bias=randn(192), residual=randn(2, 3, 192), p=0.0,
                  training=True, gamma=randn(192, scale=0.1))
    (out,), (dx, dbias, dres, dgamma) = check_matches_reference(bias_dropout_add, bias_dropout_add_ref, inputs,
                                                                torch.bfloat16)
    assert (out.dtype, dx.dtype, dbias.dtype, dres.dtype, dgamma.dtype) == (torch.float32, torch.bfloat16,
                                                                            torch.float32, torch.float32,
                                                                            torch.float32)
    x, bias, res = randn(2, 3, 192), randn(192), randn(2, 3, 192)
    dout = torch.randn(2, 3, 192)
    dx, dbias, dres = torch.autograd.grad(bias_dropout_add(x, bias, res, 0.0, False), (x, bias, res), dout)
    assert torch.equal(dx, dout) and torch.equal(dres, dout)
    assert_close(dbias, dout.double().sum((0, 1)), bound(torch.float32), "dbias")


def test_bias_dropout_add_bad_input():
    x, bias = torch.randn(2, 3, 64), torch.randn(64)
    with pytest.raises(ValueError, match="residual of shape"):
        bias_dropout_add(x, bias, torch.randn(2, 3, 65), 0.0, False)
    with pytest.raises(ValueError, match=r"sample_scale of shape \(2,\)"):
        bias_dropout_add(x, bias, x, 0.0, False, sample_scale=torch.ones(6))
    with pytest.raises(ValueError, match="dropout probability"):
        bias_dropout_add(x, bias, x, 1.5, True)
    with pytest.raises(ValueError, match="dtype"):
        bias_dropout_add(x, bias, x, 0.0, False, sample_scale=torch.ones(2, dtype=torch.float16))


def test_bias_dropout_add_launches_and_bytes(traffic):
    """Forward 1 launch: x and residual read once, out written once (3s). Backward with dropout and
    LayerScale, 2 launches: dout and x read once, dx written once (3s); plain: dout only (1s)."""
    m, d = 24, 768
    x, res, dout = (torch.randn(m, d, dtype=torch.bfloat16) for _ in range(3))
    bias, gamma = torch.randn(d), torch.randn(d)
    out = bg.bias_dropout_add_fwd(x, bias, res, gamma, None, 0.1, torch.tensor([7]))
    assert traffic.launches == ["_bias_dropout_add_fwd_kernel"]
    assert [traffic.bytes("read", t) for t in (x, res)] == [x.nbytes, res.nbytes]
    assert traffic.bytes("write", out) == out.nbytes
    traffic.clear()
    dx, _ = bg.bias_dropout_add_bwd(dout, x, bias, gamma, None, 0.1, torch.tensor([7]))
    assert traffic.launches == ["_bias_dropout_add_bwd_kernel", "_sum_partials_kernel"]
    assert [traffic.bytes("read", t) for t in (dout, x)] == [dout.nbytes, x.nbytes]
    assert traffic.bytes("write", dx) == dx.nbytes
    traffic.clear()
    dx, _ = bg.bias_dropout_add_bwd(dout, x, bias, None, None, 0.0, None)
    assert dx.numel() == 0 and traffic.bytes("read", x) == 0 and traffic.bytes("read", dout) == dout.nbytes


def test_torch_compile_dropout_without_graph_breaks(monkeypatch):
    x, bias, res = randn(2, 3, 64), randn(64), randn(2, 3, 64)
    check_compiled_dropout(lambda x, bias, res: bias_dropout_add(x, bias, res, 0.5, True), [x, bias, res],
                           monkeypatch)
    seed = torch.tensor([7])  # the custom ops take the seed tensor itself (schema, fake impl)
    x2, res2, gamma = x.detach().view(6, 64), res.detach().view(6, 64), randn(64, grad=False)
    torch.library.opcheck(bg.bias_dropout_add_fwd.default, (x2, bias.detach(), res2, gamma, None, 0.5, seed),
                          test_utils=("test_schema", "test_faketensor"))
    torch.library.opcheck(bg.bias_dropout_add_bwd.default, (res2, x2, bias.detach(), gamma, None, 0.5, seed),
                          test_utils=("test_schema", "test_faketensor"))


def test_torch_compile_fullgraph_traces_custom_ops():
    torch._dynamo.reset()
    x, bias, res = randn(2, 3, 64), randn(64), randn(2, 3, 64)

    def block(x, bias, res):
        return bias_dropout_add(bias_gelu(x, bias, "tanh"), bias, res, 0.0, False)

    compiled = torch.compile(block, fullgraph=True, backend="aot_eager")
    out = compiled(x, bias, res)
    assert_close(out, block(x, bias, res).double(), bound(torch.float32), "compiled")
    out.sum().backward()
    assert x.grad is not None and bias.grad is not None


def test_strided_and_expanded_parameters():
    torch.manual_seed(9)
    n = 192
    strided, expanded = strided_and_expanded(n)
    check_matches_reference(bias_gelu, bias_gelu_ref, dict(x=randn(2, 5, n), bias=strided, approximate="none"),
                            torch.float32)
    check_matches_reference(bias_gelu, bias_gelu_ref, dict(x=randn(2, 5, n), bias=expanded, approximate="none"),
                            torch.float32)
    scale = torch.tensor([1.25, 0.0, 0.0, 1.25], device=DEVICE)[::2]  # strided drop-path scale (B = 2)
    check_matches_reference(bias_dropout_add, bias_dropout_add_ref,
            dict(x=randn(2, 5, n), bias=strided, residual=randn(2, 5, n), p=0.0, training=False, gamma=expanded,
                 sample_scale=scale), torch.float32)
