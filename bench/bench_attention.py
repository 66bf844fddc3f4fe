"""GPU micro-benchmark of kernels/attention.py against PyTorch (not a test; asserts no timing).

From the packed qkv (B, N, 3 * H * D) to the proj input (B, N, H * D), forward and forward+backward,
for vit_fast's kernel, F.scaled_dot_product_attention (flash and memory-efficient backends, fed the
permuted views as timm does, output transposed back), eager attention (timm's fused_attn=False path)
and torch.compile of the eager path. Prints median times (triton.testing.do_bench, which flushes L2
between runs) and TFLOP/s counting 4 * B * H * N^2 * D per forward and 2.5x that per backward.

    python bench/bench_attention.py [--batch 256] [--heads 12] [--head-dim 64] [--tokens 197 577 1025] [--csv out.csv]

Without CUDA it prints one line and exits 0.
"""
from __future__ import annotations

import argparse
import json
import sys

import torch

from vit_fast.tools.bench import PEAK_TFLOPS, environment, write_csv  # dense bf16/fp16 peaks, result tagging


def split_qkv(qkv: torch.Tensor, num_heads: int):
    B, N, width = qkv.shape
    return qkv.view(B, N, 3, num_heads, width // (3 * num_heads)).permute(2, 0, 3, 1, 4).unbind(0)


def sdpa_provider(backend):
    from torch.nn.attention import sdpa_kernel

    def run(qkv, num_heads):
        q, k, v = split_qkv(qkv, num_heads)
        with sdpa_kernel(backend):
            out = torch.nn.functional.scaled_dot_product_attention(q, k, v)
        return out.transpose(1, 2).reshape(qkv.shape[0], qkv.shape[1], -1)

    return run


def providers() -> dict:
    """name -> fn(qkv, num_heads) -> (B, N, H * D)."""
    from torch.nn.attention import SDPBackend

    from vit_fast.kernels.attention import attention, attention_ref

    return {
        "vit_fast": attention,
        "sdpa_flash": sdpa_provider(SDPBackend.FLASH_ATTENTION),
        "sdpa_efficient": sdpa_provider(SDPBackend.EFFICIENT_ATTENTION),
        "eager": attention_ref,
        "eager_compiled": torch.compile(attention_ref, dynamic=False),
    }


def flops(batch: int, heads: int, tokens: int, head_dim: int, backward: bool) -> float:
    forward = 4.0 * batch * heads * tokens**2 * head_dim
    return forward * (3.5 if backward else 1.0)


def time_provider(fn, batch, heads, tokens, head_dim, dtype, backward: bool) -> float:
    """Median milliseconds; two input buffers alternate so no run reuses the previous one's data."""
    from triton.testing import do_bench

    inputs = [torch.randn(batch, tokens, 3 * heads * head_dim, device="cuda", dtype=dtype, requires_grad=backward)
              for _ in range(2)]
    grad = torch.randn(batch, tokens, heads * head_dim, device="cuda", dtype=dtype)
    step = [0]

    def run():
        step[0] += 1
        qkv = inputs[step[0] % 2]
        out = fn(qkv, heads)
        if backward:
            out.backward(grad)

    return do_bench(run, grad_to_none=inputs if backward else None, return_mode="median")


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, default=256)
    parser.add_argument("--heads", type=int, default=12)
    parser.add_argument("--head-dim", type=int, default=64)
    parser.add_argument("--tokens", type=int, nargs="+", default=[197, 577, 1025])
    parser.add_argument("--dtype", choices=["bf16", "fp16"], default="bf16")
    parser.add_argument("--providers", nargs="+", default=None, help="subset of providers to run")
    parser.add_argument("--csv", help="write the rows to this CSV file")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print("bench_attention: no CUDA device; this GPU micro-benchmark has nothing to measure here")
        return 0

    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}[args.dtype]
    env = environment()
    peak = next((v for k, v in PEAK_TFLOPS.items() if k in env["gpu"]), None)
    print(json.dumps(env))
    rows = []
    for name, fn in providers().items():
        if args.providers and name not in args.providers:
            continue
        for tokens in args.tokens:
            for backward in (False, True):
                shape = (args.batch, args.heads, tokens, args.head_dim)
                label = f"{name:15s} N={tokens:5d} {'fwd+bwd' if backward else 'fwd':8s}"
                try:
                    ms = time_provider(fn, *shape, dtype, backward)
                except Exception as e:  # e.g. a backend that does not support this shape or GPU
                    print(f"{label} unavailable: {type(e).__name__}: {e}"[:200])
                    continue
                tflops = flops(*shape, backward) / ms / 1e9
                ceiling = f" of {peak:.0f} peak ({100 * tflops / peak:.0f}%)" if peak else ""
                print(f"{label} {ms:8.3f} ms {tflops:7.1f} TFLOP/s{ceiling}")
                rows.append(dict(env, provider=name, batch=args.batch, heads=args.heads, tokens=tokens,
                                 head_dim=args.head_dim, dtype=args.dtype, pass_="fwd+bwd" if backward else "fwd",
                                 ms=ms, tflops=tflops))
    if args.csv and rows:
        write_csv(args.csv, rows)
    return 0


if __name__ == "__main__":
    sys.exit(main())
