"""kernels/linear_act.py: act(x @ w1^T + b1) @ w2^T against float64, forward and every gradient (x, w1, b1,
w2), in fp32 / fp16 / bf16 and autocast's mix, each activation, ViT's awkward shapes, determinism, launches
and distinct bytes per launch (vit_fast.tools.traffic.StepCounter), torch.compile and bad input."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from tests.numerics import assert_close, bound, check_matches_reference, errors, randn
from vit_fast.kernels import linear_act as la
from vit_fast.kernels._utils import interpreter_active
from vit_fast.kernels.linear_act import linear_act, linear_act_ref
from vit_fast.tools import traffic

pytestmark = pytest.mark.usefixtures("poisoned_allocations")  # every launcher allocation NaN (ints -1)


def inputs(rows, c, hidden, n, dtype, param_dtype=None, bias=True, activation="gelu"):
    """Unit-scale inputs and 1/sqrt(fan-in) weights: pre-activations of unit scale (the curved region)."""
    param_dtype = param_dtype or dtype
    return dict(x=randn(*rows, c, dtype=dtype), w1=randn(hidden, c, dtype=param_dtype, scale=c ** -0.5),
                b1=randn(hidden, dtype=param_dtype) if bias else None,
                w2=randn(n, hidden, dtype=param_dtype, scale=hidden ** -0.5), activation=activation)


def eager_mlp(x, w1, b1, w2, activation="gelu"):
    """What eager PyTorch computes under autocast: both Linears in x's dtype, the activation on fc1's output."""
    u = F.linear(x, w1.to(x.dtype), b1.to(x.dtype) if b1 is not None else None)
    return F.linear(la.act_ref(u, activation), w2.to(x.dtype))


@pytest.mark.parametrize("dtype,param_dtype,activation", [
    (torch.float32, torch.float32, "gelu"),
    (torch.float32, torch.float32, "gelu_tanh"),
    (torch.float32, torch.float32, "quick_gelu"),
    (torch.float16, torch.float16, "gelu"),
    (torch.bfloat16, torch.bfloat16, "gelu_tanh"),
    (torch.float16, torch.float32, "quick_gelu"),  # autocast: fp32 weights cast once by the launcher
    (torch.bfloat16, torch.float32, "gelu"),
])
def test_matches_reference_every_dtype(dtype, param_dtype, activation):
    """2 x 197 rows, prime C = 131 (masked reduction), H = 200, N = 80: forward and the four gradients vs
    float64 and the 2x-eager rule; outputs in x's dtype, parameter grads in the parameters' dtype."""
    torch.manual_seed(0)
    ins = inputs((2, 197), 131, 200, 80, dtype, param_dtype, activation=activation)
    (y,), (dx, dw1, db1, dw2) = check_matches_reference(linear_act, linear_act_ref, ins, dtype, eager_fn=eager_mlp)
    assert (y.dtype, dx.dtype) == (dtype, dtype) and (dw1.dtype, db1.dtype, dw2.dtype) == (param_dtype,) * 3
    assert y.shape == (2, 197, 80) and dx.shape == (2, 197, 131)


@pytest.mark.parametrize("c,hidden,activation", [(768, 3072, "gelu"), (1152, 4304, "gelu_tanh"),
                                                 (1280, 1408, "quick_gelu")])
def test_vit_shapes_bf16_autocast(c, hidden, activation):
    """197 tokens of ViT-B (768 -> 3072), SigLIP so400m (1152 -> 4304: a ragged last tile of the hidden
    dimension) and ViT-H's width 1280 (with a smaller hidden 1408 to keep the interpreter's time down),
    bf16 activations with fp32 parameters, against float64."""
    torch.manual_seed(c)
    ins = inputs((197,), c, hidden, c, torch.bfloat16, torch.float32, activation=activation)
    check_matches_reference(linear_act, linear_act_ref, ins, torch.bfloat16, eager_fn=eager_mlp)


def test_bf16_error_within_twice_eager():
    """The flash-attention rule spelled out, forward and all gradients, at a ViT-Ti-sized MLP."""
    torch.manual_seed(7)
    ins = inputs((197,), 192, 768, 192, torch.bfloat16, torch.float32)
    leaves = [ins[k] for k in ("x", "w1", "b1", "w2")]
    dy = torch.randn(197, 192, dtype=torch.float64)
    ins64 = {k: (v.detach().double().requires_grad_() if isinstance(v, torch.Tensor) else v) for k, v in ins.items()}
    y64 = linear_act_ref(**ins64)
    want = [y64] + list(torch.autograd.grad(y64, [ins64[k] for k in ("x", "w1", "b1", "w2")], dy))

    def run(fn):
        y = fn(**ins)
        return [y] + list(torch.autograd.grad(y, leaves, dy.to(y.dtype)))

    kernel, eager = run(linear_act), run(eager_mlp)
    for name, got, base, ref in zip(("y", "dx", "dw1", "db1", "dw2"), kernel, eager, want):
        kernel_err, eager_err = errors(got, ref)[0], errors(base, ref)[0]
        assert kernel_err <= 2 * eager_err + 1e-6, f"{name}: {kernel_err:.2e} > 2x eager {eager_err:.2e}"
        assert kernel_err <= bound(torch.bfloat16, "dot"), name


def test_activations_differ():
    """The three activations are told apart (fp32 resolves the tanh form's gap to the exact one)."""
    torch.manual_seed(5)
    ins = inputs((9,), 64, 96, 16, torch.float32)
    ys = {a: linear_act(**dict(ins, activation=a)).detach() for a in la.ACTIVATIONS}
    for a, y in ys.items():
        assert_close(y, linear_act_ref(**dict(ins, activation=a)).detach(), bound(torch.float32, "dot"), a)
    assert not torch.allclose(ys["gelu"], ys["gelu_tanh"], rtol=1e-5, atol=1e-6)
    assert not torch.allclose(ys["gelu"], ys["quick_gelu"], rtol=1e-3, atol=1e-4)


def test_zero_rows_one_row_and_bias_none():
    torch.manual_seed(1)
    (y,), (dx, dw1, db1, dw2) = check_matches_reference(linear_act, linear_act_ref,
                                                        inputs((0,), 24, 40, 13, torch.float32), torch.float32)
    assert y.shape == (0, 13) and dx.shape == (0, 24)
    assert torch.equal(db1, torch.zeros(40)) and torch.equal(dw1, torch.zeros(40, 24))
    assert torch.equal(dw2, torch.zeros(13, 40))
    check_matches_reference(linear_act, linear_act_ref, inputs((1,), 24, 40, 13, torch.float32, bias=False,
                                                               activation="gelu_tanh"), torch.float32)
    check_matches_reference(linear_act, linear_act_ref, inputs((3, 5), 64, 80, 32, torch.bfloat16, bias=False,
                                                               activation="quick_gelu"), torch.bfloat16)


def test_non_contiguous_inputs():
    """x with permuted leading dims and with a strided last dim (copied once); weights read through their
    row stride (column slices) and transposed weights (copied)."""
    torch.manual_seed(2)
    c, hid, n = 48, 96, 40
    x_rows = randn(5, 3, c, grad=False).transpose(0, 1).requires_grad_()
    x_strided = randn(3, 5, 2 * c, grad=False)[..., ::2].requires_grad_()
    w1_sliced = randn(hid, c + 16, grad=False, scale=c ** -0.5)[:, :c].requires_grad_()
    w2_sliced = randn(n, hid + 32, grad=False, scale=hid ** -0.5)[:, :hid].requires_grad_()
    w1_t = randn(c, hid, grad=False, scale=c ** -0.5).t().requires_grad_()
    w2_t = randn(hid, n, grad=False, scale=hid ** -0.5).t().requires_grad_()
    for x, w1, w2 in ((x_rows, w1_sliced, w2_sliced), (x_strided, w1_t, w2_t)):
        check_matches_reference(linear_act, linear_act_ref, dict(x=x, w1=w1, b1=randn(hid), w2=w2), torch.float32)


def test_sum_backward_and_determinism():
    """.sum() gives a stride-0 grad; two backward passes are bitwise equal (no atomics: fixed-order sums)."""
    torch.manual_seed(3)
    ins = inputs((2, 197), 96, 200, 80, torch.bfloat16, torch.float32)
    leaves = [ins[k] for k in ("x", "w1", "b1", "w2")]
    runs = [torch.autograd.grad(linear_act(**ins).sum(), leaves) for _ in range(2)]
    assert all(torch.equal(a, b) for a, b in zip(*runs))
    ins64 = {k: (v.detach().double().requires_grad_() if isinstance(v, torch.Tensor) else v) for k, v in ins.items()}
    want = torch.autograd.grad(linear_act_ref(**ins64).sum(), [ins64[k] for k in ("x", "w1", "b1", "w2")])
    for name, got, ref in zip(("dx", "dw1", "db1", "dw2"), runs[0], want):
        assert_close(got, ref, bound(torch.bfloat16), name)


def test_frozen_parameters_and_inference():
    """Only the GEMMs whose outputs are needed run: frozen fc1 (LoRA-style) still gets dx; a frozen fc2
    weight skips dw2; without any grad the forward writes no act'(u)."""
    torch.manual_seed(4)
    ins = inputs((2, 9), 32, 64, 16, torch.float32)
    x, w1, b1, w2 = (ins[k] for k in ("x", "w1", "b1", "w2"))
    ref = [t.detach().clone().requires_grad_() for t in (x, w1, b1, w2)]
    linear_act(*ref).sum().backward()
    linear_act(x, w1.detach(), b1.detach(), w2.detach()).sum().backward()
    assert torch.equal(x.grad, ref[0].grad)
    x.grad = None
    linear_act(x.detach(), w1, b1, w2.detach()).sum().backward()
    assert x.grad is None and torch.equal(w1.grad, ref[1].grad) and torch.equal(b1.grad, ref[2].grad)
    with torch.no_grad():
        with traffic.StepCounter() as c:
            y = linear_act(x, w1, b1, w2)
    assert torch.equal(y, linear_act(*ref).detach())
    if interpreter_active():
        fwd = [o for o in c.ops if o.triton]
        assert len(fwd) == 1 and fwd[0].bytes_written == 18 * 64 * 4  # h only


@pytest.mark.skipif(not interpreter_active(), reason="counts the interpreter's loads and stores")
def test_launches_and_distinct_bytes():
    """Forward: one Triton launch reading x, w1, b1 once and writing h and act'(u) once, then the fc2
    GEMM. Backward: the dgrad launch (reads dy, w2, act'(u); writes du and the db1 partials), the db1
    sum, and three cuBLAS GEMMs (dw2, dx, dw1). The activation is evaluated in no other launch."""
    m, c, hid, n = 150, 96, 160, 48
    x, dy = torch.randn(m, c, dtype=torch.bfloat16), torch.randn(m, n, dtype=torch.bfloat16)
    w1, b1, w2 = torch.randn(hid, c, dtype=torch.bfloat16), torch.randn(hid), torch.randn(n, hid, dtype=torch.bfloat16)
    with traffic.StepCounter() as cnt:
        h, dact = la.linear_act_fwd(x, w1, b1, "gelu", True)
    kernels = [o for o in cnt.ops if o.triton]
    assert [o.name for o in kernels] == ["_linear_act_fwd_kernel"]
    assert kernels[0].bytes_read == x.nbytes + w1.nbytes + b1.nbytes
    assert kernels[0].bytes_written == h.nbytes + dact.nbytes and kernels[0].flops >= 2 * m * c * hid
    with traffic.StepCounter() as cnt:
        du, db1 = la.linear_act_bwd(dy, dact, w2, b1)
    kernels = [o for o in cnt.ops if o.triton]
    assert [o.name for o in kernels] == ["_linear_act_bwd_kernel", "_sum_partials_kernel"]
    row_tiles = -(-m // la.linear_act_config(x.dtype, 80).bwd.block_m)
    assert kernels[0].bytes_read == dy.nbytes + w2.nbytes + dact.nbytes
    assert kernels[0].bytes_written == du.nbytes + row_tiles * hid * 4
    assert (kernels[1].bytes_read, kernels[1].bytes_written) == (row_tiles * hid * 4, db1.nbytes)
    u = (x.double() @ w1.double().t() + b1.double())
    assert_close(h, F.gelu(u), bound(torch.bfloat16), "h")
    dgelu = torch.autograd.functional.jacobian(lambda t: F.gelu(t).sum(), u[:4])  # elementwise GELU'
    assert_close(dact[:4], dgelu, bound(torch.bfloat16), "act'(u)")
    du64 = (dy.double() @ w2.double()) * dact.double()
    assert_close(du, du64, 2 ** -8, "du")  # fp32 accumulation and product, one bf16 rounding (2^-9)
    assert_close(db1, du64.sum(0), 1e-5, "db1")  # summed from the fp32 products


def test_bad_input():
    x, w1, b1, w2 = torch.randn(4, 32), torch.randn(64, 32), torch.randn(64), torch.randn(16, 64)
    with pytest.raises(ValueError, match=r"w1 of shape \(\*, 32\)"):
        linear_act(x, torch.randn(64, 33), b1, w2)
    with pytest.raises(ValueError, match=r"w2 of shape \(\*, 64\)"):
        linear_act(x, w1, b1, torch.randn(16, 63))
    with pytest.raises(ValueError, match="w1 with 2 dims"):
        linear_act(x, torch.randn(32), b1, w2)
    with pytest.raises(ValueError, match=r"b1 of shape \(64,\)"):
        linear_act(x, w1, torch.randn(16), w2)
    with pytest.raises(ValueError, match="x of shape"):
        linear_act(torch.randn(4, 0), w1, b1, w2)
    with pytest.raises(ValueError, match="dtype"):
        linear_act(x.to(torch.int32), w1, b1, w2)
    with pytest.raises(ValueError, match="autocast"):  # fp32 x with bf16 weights
        linear_act(x, w1.bfloat16(), b1, w2.bfloat16())
    with pytest.raises(ValueError, match="autocast"):  # fp16 x with bf16 parameters
        linear_act(x.half(), w1.bfloat16(), b1.bfloat16(), w2.bfloat16())
    with pytest.raises(ValueError, match="activation"):
        linear_act(x, w1, b1, w2, "relu")
    with pytest.raises((ValueError, RuntimeError), match="device"):
        linear_act(x, w1, b1.to("meta"), w2)


def test_torch_compile_fullgraph_and_custom_op_schemas():
    torch._dynamo.reset()
    ins = inputs((2, 5), 32, 64, 16, torch.float32)
    fn = lambda x, w1, b1, w2: linear_act(x, w1, b1, w2, "gelu_tanh")  # noqa: E731
    leaves = [ins[k] for k in ("x", "w1", "b1", "w2")]
    explained = torch._dynamo.explain(fn)(*leaves)
    assert (explained.graph_count, explained.graph_break_count) == (1, 0), explained.break_reasons
    compiled = torch.compile(fn, fullgraph=True, backend="aot_eager")
    got = [compiled(*leaves)]
    got += torch.autograd.grad(got[0].sum(), leaves)
    want = [fn(*leaves)]
    want += torch.autograd.grad(want[0].sum(), leaves)
    assert all(torch.equal(a, b) for a, b in zip(got, want))
    x, w1, b1, w2 = (t.detach() for t in leaves)
    x2 = x.view(10, 32)
    torch.library.opcheck(la.linear_act_fwd.default, (x2, w1, b1, "gelu", True),
                          test_utils=("test_schema", "test_faketensor"))
    torch.library.opcheck(la.linear_act_fwd.default, (x2, w1, None, "quick_gelu", False),
                          test_utils=("test_schema", "test_faketensor"))
    dact = torch.rand(10, 64)
    torch.library.opcheck(la.linear_act_bwd.default, (torch.randn(10, 16), dact, w2, b1),
                          test_utils=("test_schema", "test_faketensor"))
    torch.library.opcheck(la.linear_act_bwd.default, (torch.randn(10, 16), dact, w2, None),
                          test_utils=("test_schema", "test_faketensor"))


def test_aot_specs_cover_each_activation_and_both_archs():
    """The report compiles the fc1 forward for each activation (training and inference) on the static and on the
    co-resident tile, the dgrad and the db1 sum; sm_90 takes wgmma-sized 16-bit tiles (>= 128 x 128, grouped order)
    and sm_80 its own table (the TMA kernels' sm_90 entries: tests/test_linear_act_tma.py)."""
    for arch in (80, 90):
        specs = [s for s in la.aot_specs(dtype=torch.bfloat16, arch=arch) if not s.name.endswith("_tma")]
        for name, tile in (("linear_act_fwd", la.linear_act_config(torch.bfloat16, arch).fwd),
                           ("linear_act_fwd_co_resident", la.CO_RESIDENT[arch])):
            fwd = [s for s in specs if s.name == name]
            assert sorted({s.constexprs["ACT"] for s in fwd}) == [0, 1, 2] and len(fwd) == 6
            assert {(s.constexprs["BLOCK_M"], s.constexprs["BLOCK_N"], s.constexprs["BLOCK_K"], s.num_warps,
                     s.num_stages) for s in fwd} == {(tile.block_m, tile.block_n, tile.block_k, tile.num_warps,
                                                     tile.num_stages)}
        assert [s.name for s in specs].count("linear_act_bwd") == 1
        assert [s.name for s in specs].count("sum_partials") == 1
        for s in specs:
            if s.name == "sum_partials":
                continue
            assert s.has_dot and s.constexprs["BLOCK_M"] >= 128 and s.constexprs["BLOCK_N"] >= 128
            assert s.constexprs["GROUP_M"] > 1 and "X" in s.divisible_by_16 or "DY" in s.divisible_by_16
    fp32 = la.aot_specs(dtype=torch.float32, arch=90)
    assert {s.constexprs.get("INPUT_PRECISION") for s in fp32} == {"ieee", "tf32", None}
