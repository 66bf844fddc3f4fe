"""pytest-benchmark of kernels/patch_embed.py at ViT shapes (GPU only; `pytest bench/ --benchmark-only`).

Same providers as bench/bench_patch_embed.py (fused kernel, eager timm stack, torch.compile of it);
each round runs forward + backward (parameter gradients) under bf16 autocast with fp32 images and
parameters, and synchronises, so the wall time pytest-benchmark measures is GPU time. Asserts no timing.
"""
import pytest
import torch

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(),
                                reason="GPU-only micro-benchmark: "
                                       "the patch-embedding kernels need a CUDA device to time")

SHAPES = [(256, 224, 16, 768), (64, 224, 14, 1280), (128, 384, 16, 768)]  # ViT-B/16, ViT-H/14, ViT-B/16@384


@pytest.mark.parametrize("provider", ["vit_fast", "eager", "eager_compiled"])
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "B{}-{}px-P{}-D{}".format(*s))
def test_patch_embed_fwd_bwd(benchmark, provider, shape):
    from bench.bench_patch_embed import make_inputs, providers

    batch, img, patch, width = shape
    fn = providers()[provider]
    images, params = make_inputs(batch, img, patch, width, 3, pure_bf16=False)
    grad = []

    def step():
        for p in params:
            p.grad = None
        with torch.autocast("cuda", dtype=torch.bfloat16):
            out = fn(images[0], *params)
        if not grad:
            grad.append(torch.randn_like(out))
        out.backward(grad[0])
        torch.cuda.synchronize()

    step()  # compile / warm up outside the measurement
    K, Np = 3 * patch * patch, (img // patch) ** 2
    benchmark.extra_info.update(gflop=4.0 * batch * Np * K * width / 1e9, gpu=torch.cuda.get_device_name())
    benchmark.pedantic(step, rounds=20, warmup_rounds=3)
