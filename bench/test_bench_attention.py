"""pytest-benchmark of kernels/attention.py at ViT shapes (GPU only; `pytest bench/ --benchmark-only`).

Same providers as bench/bench_attention.py; each round runs forward + backward on bf16 inputs and
synchronises, so the wall time pytest-benchmark measures is GPU time. Asserts no timing.
"""
import pytest
import torch

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(),
                                reason="GPU-only micro-benchmark: attention kernels need a CUDA device to time")

SHAPES = [(256, 12, 197, 64), (64, 12, 577, 64), (32, 16, 257, 80)]  # ViT-B/16, ViT-B/16@384, ViT-H/14


@pytest.mark.parametrize("provider", ["vit_fast", "sdpa_flash", "sdpa_efficient", "eager"])
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "B{}-H{}-N{}-D{}".format(*s))
def test_attention_fwd_bwd(benchmark, provider, shape):
    from bench.bench_attention import flops, providers

    B, H, N, D = shape
    fn = providers()[provider]
    qkv = torch.randn(B, N, 3 * H * D, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    grad = torch.randn(B, N, H * D, device="cuda", dtype=torch.bfloat16)

    def step():
        qkv.grad = None
        fn(qkv, H).backward(grad)
        torch.cuda.synchronize()

    step()  # compile / warm up outside the measurement
    benchmark.extra_info.update(gflop=flops(B, H, N, D, backward=True) / 1e9, gpu=torch.cuda.get_device_name())
    benchmark.pedantic(step, rounds=20, warmup_rounds=3)
