"""kernels/gelu_linear.py: GELU(h + bias) @ W^T against float64, forward and the three gradients, in
fp32 / fp16 / bf16 and autocast's mix (half h, fp32 parameters), plus split dW, determinism, launches
and distinct bytes per launch (vit_fast.tools.traffic.StepCounter), torch.compile and bad input."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from tests.numerics import assert_close, bound, check_matches_reference, errors, randn
from vit_fast.tools import traffic
from vit_fast.kernels import gelu_linear as gl
from vit_fast.kernels._utils import interpreter_active
from vit_fast.kernels.gelu_linear import gelu_linear, gelu_linear_ref

pytestmark = pytest.mark.usefixtures("poisoned_allocations")

HALF = (torch.float16, torch.bfloat16)


def inputs(rows, k, n, dtype, param_dtype=None, bias=True, approximate="none"):
    """Pre-activations of unit scale (GELU's curved region), a 1/sqrt(K)-scaled weight."""
    param_dtype = param_dtype or dtype
    return dict(h=randn(*rows, k, dtype=dtype, scale=1.5), bias=randn(k, dtype=param_dtype) if bias else None,
                weight=randn(n, k, dtype=param_dtype, scale=k ** -0.5), approximate=approximate)


def eager_gelu_linear(h, bias, weight, approximate="none"):
    """What eager PyTorch computes under autocast: GELU in h + bias's promoted dtype, Linear in h's dtype."""
    u = h + bias if bias is not None else h
    return F.linear(F.gelu(u, approximate=approximate).to(h.dtype), weight.to(h.dtype))


@pytest.mark.parametrize("dtype,param_dtype,approximate", [
    (torch.float32, torch.float32, "none"),
    (torch.float16, torch.float16, "none"),
    (torch.bfloat16, torch.bfloat16, "tanh"),
    (torch.float16, torch.float32, "tanh"),  # autocast: fp32 weight cast in registers
    (torch.bfloat16, torch.float32, "none"),
])
def test_matches_reference_every_dtype(dtype, param_dtype, approximate):
    """2 x 197 rows, prime K = 131, N = 80: forward, dh, dbias, dW vs float64 and the 2x-eager rule;
    outputs in h's dtype, parameter grads in the parameters' dtype."""
    torch.manual_seed(0)
    ins = inputs((2, 197), 131, 80, dtype, param_dtype, approximate=approximate)
    (y,), (dh, dbias, dw) = check_matches_reference(gelu_linear, gelu_linear_ref, ins, dtype,
                                                    eager_fn=eager_gelu_linear)
    assert (y.dtype, dh.dtype, dbias.dtype, dw.dtype) == (dtype, dtype, param_dtype, param_dtype)
    assert y.shape == (2, 197, 80)


@pytest.mark.parametrize("n", [192, 13])
def test_vit_tiny_hidden_bf16_autocast(n):
    """ViT-Ti's MLP (K = 768 -> N = 192) and an odd N, bf16 activations, fp32 parameters."""
    torch.manual_seed(n)
    check_matches_reference(gelu_linear, gelu_linear_ref, inputs((197,), 768, n, torch.bfloat16, torch.float32),
                            torch.bfloat16, eager_fn=eager_gelu_linear)


def test_bf16_error_within_twice_eager():
    """The flash-attention rule spelled out on a ViT-Ti-sized MLP, forward and all gradients: eager is
    F.linear(F.gelu(h + b).to(bf16), w.to(bf16)) run in bf16 (autocast's computation)."""
    torch.manual_seed(7)
    ins = inputs((197,), 768, 192, torch.bfloat16, torch.float32)
    leaves = [ins["h"], ins["bias"], ins["weight"]]
    dy = torch.randn(197, 192, dtype=torch.float64)
    ins64 = {k: (v.detach().double().requires_grad_() if isinstance(v, torch.Tensor) else v) for k, v in ins.items()}
    y64 = gelu_linear_ref(**ins64)
    want = [y64] + list(torch.autograd.grad(y64, [ins64[k] for k in ("h", "bias", "weight")], dy))
    def run(fn):
        y = fn(**ins)
        return [y] + list(torch.autograd.grad(y, leaves, dy.to(y.dtype)))

    kernel, eager = run(gelu_linear), run(eager_gelu_linear)
    for name, got, base, ref in zip(("y", "dh", "dbias", "dW"), kernel, eager, want):
        kernel_err, eager_err = errors(got, ref)[0], errors(base, ref)[0]
        assert kernel_err <= 2 * eager_err + 1e-6, f"{name}: {kernel_err:.2e} > 2x eager {eager_err:.2e}"
        assert kernel_err <= bound(torch.bfloat16, "dot"), name


def test_zero_rows_one_row_and_bias_none():
    """fp32 tells the tanh form from the exact one (their gap is far above fp32's bound, not bf16's)."""
    torch.manual_seed(1)
    (y,), (dh, dbias, dw) = check_matches_reference(gelu_linear, gelu_linear_ref, inputs((0,), 131, 13, torch.float32),
                                                    torch.float32)
    assert y.shape == (0, 13) and dh.shape == (0, 131)
    assert torch.equal(dbias, torch.zeros(131)) and torch.equal(dw, torch.zeros(13, 131))
    check_matches_reference(gelu_linear, gelu_linear_ref, inputs((1,), 131, 13, torch.float32, bias=False,
                                                                approximate="tanh"), torch.float32)
    check_matches_reference(gelu_linear, gelu_linear_ref, inputs((3, 5), 64, 80, torch.bfloat16, bias=False,
                                                                approximate="tanh"), torch.bfloat16)


def test_non_contiguous_inputs():
    """h with permuted leading dims and with a strided last dim (copied once); a weight read through
    its row stride (a column slice) and a transposed weight (copied)."""
    torch.manual_seed(2)
    k, n = 96, 48
    h_rows = randn(5, 3, k, grad=False).transpose(0, 1).requires_grad_()
    h_strided = randn(3, 5, 2 * k, grad=False)[..., ::2].requires_grad_()
    w_sliced = randn(n, k + 32, grad=False, scale=k ** -0.5)[:, :k].requires_grad_()
    w_transposed = randn(k, n, grad=False, scale=k ** -0.5).t().requires_grad_()
    for h, w in ((h_rows, w_sliced), (h_strided, w_transposed)):
        check_matches_reference(gelu_linear, gelu_linear_ref, dict(h=h, bias=randn(k), weight=w), torch.float32)


def test_sum_backward_and_determinism():
    """.sum() gives a stride-0 grad; two backward passes are bitwise equal."""
    torch.manual_seed(3)
    ins = inputs((2, 197), 131, 80, torch.bfloat16, torch.float32)
    leaves = [ins["h"], ins["bias"], ins["weight"]]
    runs = [torch.autograd.grad(gelu_linear(**ins).sum(), leaves) for _ in range(2)]
    assert all(torch.equal(a, b) for a, b in zip(*runs))
    ins64 = {k: (v.detach().double().requires_grad_() if isinstance(v, torch.Tensor) else v) for k, v in ins.items()}
    want = torch.autograd.grad(gelu_linear_ref(**ins64).sum(), [ins64["h"], ins64["bias"], ins64["weight"]])
    for name, got, ref in zip(("dh", "dbias", "dW"), runs[0], want):
        assert_close(got, ref, bound(torch.bfloat16), name)


def test_split_dw_matches_unsplit_and_is_deterministic():
    """dW over the rows in 4 chunks of fp32 partials (+ sum_partials) against the one-pass dW."""
    torch.manual_seed(4)
    ins = inputs((394,), 131, 80, torch.bfloat16, torch.float32, approximate="tanh")
    h, bias, w = ins["h"].detach(), ins["bias"].detach(), ins["weight"].detach()
    dy = torch.randn(394, 80).to(torch.bfloat16)
    one = gl.gelu_linear_bwd(dy, h, bias, w, "tanh", 1)
    split = gl.gelu_linear_bwd(dy, h, bias, w, "tanh", 4)
    assert torch.equal(one[0], split[0]) and torch.equal(one[1], split[1])  # dh, dbias do not depend on it
    assert torch.equal(split[2], gl.gelu_linear_bwd(dy, h, bias, w, "tanh", 4)[2])
    g64 = F.gelu(h.double() + bias.double(), approximate="tanh").to(torch.bfloat16).double()
    for dw in (one[2], split[2]):
        assert dw.dtype == torch.float32
        assert_close(dw, dy.double().t() @ g64, 1e-5, "dW")  # fp32 accumulation of bf16 products
    assert_close(split[2], one[2], 1e-6, "split vs one pass")


def test_dw_split_choice():
    """Split only when the output tiles cannot fill a GPU and the rows are many; chunks of whole steps."""
    assert gl.dw_splits(394, 12, 32) == (1, 416)  # test-sized: no split
    s, per = gl.dw_splits(256 * 197, 2 * 6, 32)  # ViT-Ti at batch 256: 12 output tiles
    assert s > 8 and per % 32 == 0 and (s - 1) * per < 256 * 197 <= s * per
    assert gl.dw_splits(256 * 197, 6 * 24, 32)[0] == 2  # ViT-B: 144 tiles
    assert gl.dw_splits(256 * 197, 300, 32)[0] == 1
    assert gl._split_rows(100, 8, 32) == (4, 32)  # no empty splits


def test_bad_input():
    h, b, w = torch.randn(4, 64), torch.randn(64), torch.randn(32, 64)
    with pytest.raises(ValueError, match=r"weight of shape \(N, K\)"):
        gelu_linear(h, b, torch.randn(32, 65))
    with pytest.raises(ValueError, match="weight with 2 dims"):
        gelu_linear(h, b, torch.randn(64))
    with pytest.raises(ValueError, match=r"bias of shape \(64,\)"):
        gelu_linear(h, torch.randn(32), w)
    with pytest.raises(ValueError, match="dtype"):
        gelu_linear(h.to(torch.int32), b, w)
    with pytest.raises(ValueError, match="autocast"):  # fp32 h with bf16 weight
        gelu_linear(h, b, w.to(torch.bfloat16))
    with pytest.raises(ValueError, match="autocast"):  # half h, fp32 weight, half bias
        gelu_linear(h.half(), b.half(), w)
    with pytest.raises(ValueError, match="autocast"):  # fp16 h with bf16 parameters
        gelu_linear(h.half(), b.bfloat16(), w.bfloat16())
    with pytest.raises(ValueError, match="approximate"):
        gelu_linear(h, b, w, "sigmoid")
    with pytest.raises((ValueError, RuntimeError), match="device"):
        gelu_linear(h, b.to("meta"), w)


@pytest.mark.skipif(not interpreter_active(), reason="counts the interpreter's loads and stores")
def test_launches_and_distinct_bytes():
    """Forward: 1 launch reading h, W, bias once and writing y once (no g). Backward: dh (reads dy,
    W, h, bias; writes dh and the dbias partials), the dbias sum, dW (reads dy, h, bias; writes dW)."""
    m, k, n = 150, 96, 48
    h, dy = torch.randn(m, k, dtype=torch.bfloat16), torch.randn(m, n, dtype=torch.bfloat16)
    bias, w = torch.randn(k), torch.randn(n, k)
    with traffic.StepCounter() as c:
        y = gl.gelu_linear_fwd(h, bias, w, "none")
    kernels = [o for o in c.ops if o.triton]
    assert [o.name for o in kernels] == ["_gelu_linear_fwd_kernel"]
    assert kernels[0].bytes_read == h.nbytes + w.nbytes + bias.nbytes
    assert kernels[0].bytes_written == y.nbytes and kernels[0].flops >= 2 * m * n * k
    with traffic.StepCounter() as c:
        dh, dbias, dw = gl.gelu_linear_bwd(dy, h, bias, w, "none", 0)
    kernels = [o for o in c.ops if o.triton]
    assert [o.name for o in kernels] == ["_gelu_linear_dh_kernel", "_sum_partials_kernel", "_gelu_linear_dw_kernel"]
    dh_op, sum_op, dw_op = kernels
    row_tiles = -(-m // gl.gelu_linear_config(h.dtype, 80).dh.block_m)
    assert dh_op.bytes_read == dy.nbytes + w.nbytes + h.nbytes + bias.nbytes
    assert dh_op.bytes_written == dh.nbytes + row_tiles * k * 4
    assert (sum_op.bytes_read, sum_op.bytes_written) == (row_tiles * k * 4, dbias.nbytes)
    assert dw_op.bytes_read == dy.nbytes + h.nbytes + bias.nbytes and dw_op.bytes_written == dw.nbytes


def test_frozen_weight_skips_the_dw_gemm():
    """A weight without requires_grad (e.g. a LoRA base weight): no dW launch, the other grads unchanged."""
    ins = inputs((2, 9), 64, 48, torch.float32)
    h, bias = ins["h"].requires_grad_(), ins["bias"].requires_grad_()
    frozen = ins["weight"].detach()
    with traffic.StepCounter() as c:
        gelu_linear(h, bias, frozen).sum().backward()
    names = [o.name for o in c.ops if o.triton]
    assert "_gelu_linear_dw_kernel" not in names and "_gelu_linear_dh_kernel" in names, names
    assert frozen.grad is None
    h2, bias2, w2 = (t.detach().clone().requires_grad_() for t in (h, bias, frozen))
    gelu_linear(h2, bias2, w2).sum().backward()
    assert torch.equal(h.grad, h2.grad) and torch.equal(bias.grad, bias2.grad)
    torch.library.opcheck(gl.gelu_linear_bwd, (torch.randn(18, 48), h.detach().view(18, 64), None, frozen, "none", 0,
                                               False), test_utils=("test_schema", "test_faketensor"))


def test_torch_compile_fullgraph_and_custom_op_schemas():
    torch._dynamo.reset()
    ins = inputs((2, 5), 64, 48, torch.float32)
    fn = lambda h, bias, weight: gelu_linear(h, bias, weight, "tanh")  # noqa: E731
    leaves = [ins["h"], ins["bias"], ins["weight"]]
    explained = torch._dynamo.explain(fn)(*leaves)
    assert (explained.graph_count, explained.graph_break_count) == (1, 0), explained.break_reasons
    compiled = torch.compile(fn, fullgraph=True, backend="aot_eager")
    got = [compiled(*leaves)]
    got += torch.autograd.grad(got[0].sum(), leaves)
    want = [fn(*leaves)]
    want += torch.autograd.grad(want[0].sum(), leaves)
    assert all(torch.equal(a, b) for a, b in zip(got, want))
    h, b, w = (t.detach() for t in leaves)
    h2 = h.view(10, 64)
    torch.library.opcheck(gl.gelu_linear_fwd, (h2, b, w, "none"), test_utils=("test_schema", "test_faketensor"))
    torch.library.opcheck(gl.gelu_linear_bwd, (torch.randn(10, 48), h2, None, w, "none", 0),
                          test_utils=("test_schema", "test_faketensor"))
