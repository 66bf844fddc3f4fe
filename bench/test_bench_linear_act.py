"""pytest-benchmark of kernels/linear_act.py: forward+backward of GELU(x W1^T + b1) W2^T (the MLP, fc2's bias
left to the residual join) at ViT-B and ViT-L MLP shapes, 64 images x 197 tokens, bf16 activations with fp32
parameters. Compared in the same run with eager PyTorch (cuBLAS GEMMs + a separate GELU) and torch.compile of
that. GPU-only; no timing is asserted. The median of triton.testing.do_bench and the TFLOP/s (2 GEMMs forward,
4 backward: 12 M N K flops) are printed and stored in the benchmark's extra_info next to the dense bf16 peak.

    pytest bench/test_bench_linear_act.py --benchmark-only -s
"""
import pytest
import torch

from bench.bench_linear_act import eager_mlp  # shared with the campaign

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(),
                                reason="GPU-only benchmark: needs CUDA (the kernels are tested on CPU in tests/)")

ROWS = 64 * 197
SHAPES = {"vit_base": (768, 3072), "vit_large": (1024, 4096)}  # (width N, MLP hidden K)
ROTATE = 4  # input sets cycled through so no timing reads a warm L2


def _impl(name):
    if name == "triton":
        from vit_fast.kernels.linear_act import linear_act
        return linear_act
    if name == "compile":
        return torch.compile(eager_mlp)
    return eager_mlp


@pytest.mark.parametrize("impl", ["triton", "eager", "compile"])
@pytest.mark.parametrize("shape", list(SHAPES))
def test_fwd_bwd(benchmark, shape, impl):
    import triton

    from vit_fast.tools.bench import environment, peak_tflops

    n, k = SHAPES[shape]
    fn = _impl(impl)
    sets = []
    for _ in range(ROTATE):
        x = torch.randn(ROWS, n, device="cuda", dtype=torch.bfloat16, requires_grad=True)
        w1 = (torch.randn(k, n, device="cuda") * n ** -0.5).to(torch.bfloat16).requires_grad_()
        b1 = torch.randn(k, device="cuda", dtype=torch.bfloat16, requires_grad=True)
        w2 = (torch.randn(n, k, device="cuda") * k ** -0.5).to(torch.bfloat16).requires_grad_()
        sets.append(((x, w1, b1, w2), torch.randn(ROWS, n, device="cuda", dtype=torch.bfloat16)))
    state = {"i": 0}

    def step():
        inputs, dy = sets[state["i"] % ROTATE]
        state["i"] += 1
        torch.autograd.grad(fn(*inputs), inputs, dy)

    step()  # compile / warm up outside the timings
    torch.cuda.synchronize()
    ms = triton.testing.do_bench(step, warmup=25, rep=200, return_mode="median")
    tflops = 12 * ROWS * n * k / (ms * 1e-3) / 1e12
    peak = peak_tflops(torch.cuda.get_device_name(), torch.bfloat16, None)
    benchmark.extra_info.update(environment(), shape=shape, impl=impl, median_ms=ms, tflops=tflops, peak_tflops=peak)
    print(f"\nlinear_act fwd+bwd {shape} M={ROWS} N={n} K={k} {impl}: {ms:.3f} ms, {tflops:.0f} TFLOP/s "
          f"(dense bf16 peak {peak} TFLOP/s)")

    def timed():
        step()
        torch.cuda.synchronize()

    benchmark.pedantic(timed, rounds=20, iterations=5, warmup_rounds=2)
