"""GPU micro-benchmark of kernels/patch_embed.py against PyTorch (not a test; asserts no timing).

Images -> tokens (B, 1 + Hp*Wp, D) with a class token and a position embedding covering it, forward and
forward+backward (parameter gradients; the images need none), for vit_fast's fused kernel, the eager
timm stack (Conv2d -> flatten -> transpose -> cat(cls) -> + pos_embed) and torch.compile of that stack.
Default: mixed precision as in training, fp32 images and parameters under bf16 autocast; --pure-bf16
makes everything bf16. Prints median times (triton.testing.do_bench), TFLOP/s (2 * B * Np * K * D per
GEMM; forward+backward adds the dW GEMM) and the GB/s of the fused kernel's minimum traffic.

    python bench/bench_patch_embed.py [--batch 256] [--img 224] [--patch 16] [--width 768] [--csv out.csv]

Without CUDA it prints one line and exits 0.
"""
from __future__ import annotations

import argparse
import contextlib
import functools
import json
import sys

import torch
import torch.nn.functional as F

from vit_fast.tools.bench import environment, write_csv

PEAK = {"A100": (312.0, 2.0), "H100": (989.0, 3.35), "H200": (989.0, 4.8)}  # bf16 TFLOP/s, HBM TB/s


def eager_stack(images, weight, bias, pos_embed, cls_token):
    """timm PatchEmbed + _pos_embed, op for op (under autocast its tokens come out fp32)."""
    x = F.conv2d(images, weight, bias, stride=weight.shape[-1]).flatten(2).transpose(1, 2)
    return torch.cat([cls_token.expand(x.shape[0], -1, -1), x], dim=1) + pos_embed


def providers(autocast: bool = True) -> dict:
    """Under autocast the model's tokens are fp32 (timm's fp32 pos_embed add), so vit_fast writes fp32 tokens too."""
    from vit_fast.kernels.patch_embed import patch_embed

    return {
        "vit_fast": functools.partial(patch_embed, tokens_dtype=torch.float32) if autocast else patch_embed,
        "eager": eager_stack,
        "eager_compiled": torch.compile(eager_stack, dynamic=False),
    }


def make_inputs(batch, img, patch, width, in_chans, pure_bf16):
    dtype = torch.bfloat16 if pure_bf16 else torch.float32
    Np = (img // patch) ** 2

    def param(*shape, scale=0.02):
        return (torch.randn(*shape, device="cuda") * scale).to(dtype).requires_grad_()

    images = [torch.randn(batch, in_chans, img, img, device="cuda", dtype=dtype) for _ in range(2)]
    params = [param(width, in_chans, patch, patch), param(width), param(1, 1 + Np, width), param(1, 1, width)]
    return images, params


def min_bytes(batch, img, patch, width, in_chans, image_bytes, param_bytes, backward):
    """Each input read once, each output written once (what the fused kernel aims at); the backward
    reads dtokens and the images and writes the parameter gradients. Tokens in the parameters' dtype (fp32
    under autocast, as the model's)."""
    T = (img // patch) ** 2 + 1
    images = batch * in_chans * img * img * image_bytes
    params = (width * in_chans * patch * patch + width + T * width + width) * param_bytes
    tokens = batch * T * width * param_bytes
    return (2 if backward else 1) * (images + params + tokens)


def time_provider(fn, images, params, autocast, backward) -> float:
    from triton.testing import do_bench

    step = [0]
    grad = [None]

    def run():
        step[0] += 1
        ctx = torch.autocast("cuda", dtype=torch.bfloat16) if autocast else contextlib.nullcontext()
        with ctx:
            out = fn(images[step[0] % 2], *params)
        if backward:
            if grad[0] is None or grad[0].dtype != out.dtype:
                grad[0] = torch.randn_like(out)
            out.backward(grad[0])

    run()  # compile / warm up
    return do_bench(run, grad_to_none=params if backward else None, return_mode="median")


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, default=256)
    parser.add_argument("--img", type=int, default=224)
    parser.add_argument("--patch", type=int, default=16)
    parser.add_argument("--width", type=int, default=768)
    parser.add_argument("--in-chans", type=int, default=3)
    parser.add_argument("--pure-bf16", action="store_true", help="bf16 images and parameters, no autocast")
    parser.add_argument("--csv", help="write the rows to this CSV file")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print("bench_patch_embed: no CUDA device; this GPU micro-benchmark has nothing to measure here")
        return 0

    env = environment()
    peak_tflops, peak_tbs = next((v for k, v in PEAK.items() if k in env["gpu"]), (None, None))
    print(json.dumps(env))
    shape = (args.batch, args.img, args.patch, args.width)
    images, params = make_inputs(*shape, args.in_chans, args.pure_bf16)
    K, Np = args.in_chans * args.patch**2, (args.img // args.patch) ** 2
    gemm_flop = 2.0 * args.batch * Np * K * args.width
    elt = 2 if args.pure_bf16 else 4
    rows = []
    for name, fn in providers(autocast=not args.pure_bf16).items():
        for backward in (False, True):
            ms = time_provider(fn, images, params, autocast=not args.pure_bf16, backward=backward)
            tflops = gemm_flop * (2 if backward else 1) / ms / 1e9
            gbs = min_bytes(*shape, args.in_chans, elt, elt, backward) / ms / 1e6
            ceiling = f" (peaks {peak_tflops:.0f} TFLOP/s, {peak_tbs * 1e3:.0f} GB/s)" if peak_tflops else ""
            print(f"{name:15s} {'fwd+bwd' if backward else 'fwd':8s} {ms:8.3f} ms {tflops:7.1f} TFLOP/s "
                  f"{gbs:7.0f} GB/s of minimum traffic{ceiling}")
            rows.append(dict(env, provider=name, batch=args.batch, img=args.img, patch=args.patch, width=args.width,
                             pure_bf16=args.pure_bf16, pass_="fwd+bwd" if backward else "fwd", ms=ms, tflops=tflops,
                             gbs_min=gbs))
    if args.csv and rows:
        write_csv(args.csv, rows)
    return 0


if __name__ == "__main__":
    sys.exit(main())
