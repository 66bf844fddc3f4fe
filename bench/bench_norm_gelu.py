"""GPU micro-benchmark of kernels/layer_norm.py and kernels/bias_gelu.py (not a test).

At ViT-B/16 training shapes (256 images x 197 tokens, width 768, MLP 3072, bf16 activations,
fp32 parameters as under autocast) it times forward and forward+backward of every function with
triton.testing.do_bench (median) against torch eager and torch.compile of the same unfused math,
and prints the achieved GB/s of the Triton kernels from the bytes each must move (module
docstrings) next to the HBM ceiling. Without CUDA it prints one line and exits 0.

    python bench/bench_norm_gelu.py [--batch 256] [--json out.json]
"""
from __future__ import annotations

import argparse
import json
import sys
from dataclasses import dataclass
from typing import Callable

import torch
import torch.nn.functional as F

from vit_fast.tools.bench import environment

HBM_TB_S = {"H100": 3.35, "H200": 4.8, "A100": 2.0}  # datasheet ceilings (CONTRIBUTING.md 5; H200 spec sheet)


@dataclass
class Case:
    name: str
    make: Callable[[], dict]  # fresh inputs
    kernel: Callable[..., object]
    eager: Callable[..., object]
    fwd_bytes_per_elem: float  # activation bytes the kernel moves per element (module docstrings)
    bwd_bytes_per_elem: float
    width: int


def cases(rows: int, width: int = 768, hidden: int = 3072, p: float = 0.1, dev: str = "cuda") -> list[Case]:
    from vit_fast.kernels.bias_gelu import bias_dropout_add, bias_dropout_add_ref, bias_gelu
    from vit_fast.kernels.layer_norm import add_layer_norm, layer_norm

    bf16 = torch.bfloat16

    def act(n, grad=True):
        return torch.randn(rows, n, device=dev, dtype=bf16, requires_grad=grad)

    def par(n, scale=1.0):
        return (torch.randn(n, device=dev) * scale).requires_grad_()

    def eager_ln(x, weight, bias, eps=1e-6):
        return F.layer_norm(x, x.shape[-1:], weight.to(x.dtype), bias.to(x.dtype), eps)

    def eager_add_ln(x, residual, weight, bias, eps=1e-6, branch_bias=None, gamma=None, **_):
        branch = x + branch_bias.to(x.dtype) if branch_bias is not None else x
        h = residual + (branch * gamma.to(x.dtype) if gamma is not None else branch)
        return eager_ln(h, weight, bias, eps), h

    def eager_bias_gelu(x, bias, approximate="none"):
        return F.gelu(x + bias.to(x.dtype), approximate=approximate)

    def eager_bda(x, bias, residual, p, training, gamma=None):
        return bias_dropout_add_ref(x, bias.to(x.dtype), residual, p, training, gamma=gamma.to(x.dtype))

    s = 2  # bytes per bf16 element
    return [
        Case("layer_norm", lambda: dict(x=act(width), weight=par(width), bias=par(width)), layer_norm, eager_ln,
             2 * s, 3 * s, width),
        Case("add_layer_norm", lambda: dict(x=act(width), residual=act(width), weight=par(width), bias=par(width)),
             add_layer_norm, eager_add_ln, 4 * s, 4 * s, width),
        Case("add_layer_norm+bias+gamma", lambda: dict(x=act(width), residual=act(width), weight=par(width),
                                                       bias=par(width), branch_bias=par(width),
                                                       gamma=par(width, 0.1)),
             add_layer_norm, eager_add_ln, 4 * s, 6 * s, width),
        Case("bias_gelu", lambda: dict(x=act(hidden), bias=par(hidden)), bias_gelu, eager_bias_gelu, 2 * s, 3 * s,
             hidden),
        Case("bias_gelu_tanh", lambda: dict(x=act(hidden), bias=par(hidden), approximate="tanh"), bias_gelu,
             eager_bias_gelu, 2 * s, 3 * s, hidden),
        Case(f"bias_dropout_add p={p}+gamma", lambda: dict(x=act(width), bias=par(width), residual=act(width), p=p,
                                                          training=True, gamma=par(width, 0.1)),
             bias_dropout_add, eager_bda, 3 * s, 3 * s, width),
    ]


def _outputs(out):
    return out if isinstance(out, tuple) else (out,)


def time_case(case: Case, rows: int) -> dict:
    import triton.testing

    inputs = case.make()
    leaves = [v for v in inputs.values() if isinstance(v, torch.Tensor) and v.requires_grad]
    compiled = torch.compile(case.eager)
    result = {"case": case.name, "rows": rows, "width": case.width}
    for label, fn in (("triton", case.kernel), ("eager", case.eager), ("compile", compiled)):
        outs = _outputs(fn(**inputs))
        grads = [torch.randn_like(o) for o in outs]

        def fwd():
            return fn(**inputs)

        def fwd_bwd():
            return torch.autograd.grad(_outputs(fn(**inputs)), leaves, grads)

        result[f"{label}_fwd_ms"] = triton.testing.do_bench(fwd, return_mode="median")
        result[f"{label}_fwd_bwd_ms"] = triton.testing.do_bench(fwd_bwd, return_mode="median")
    elems = rows * case.width
    result["fwd_GBps"] = case.fwd_bytes_per_elem * elems / result["triton_fwd_ms"] / 1e6
    result["fwd_bwd_GBps"] = (case.fwd_bytes_per_elem + case.bwd_bytes_per_elem) * elems / \
        result["triton_fwd_bwd_ms"] / 1e6
    return result


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, default=256, help="images (x 197 tokens)")
    parser.add_argument("--json", help="write the results here")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print("bench_norm_gelu: no CUDA device; this GPU micro-benchmark has nothing to time here.")
        return 0
    env = environment()
    ceiling = next((v for k, v in HBM_TB_S.items() if k in env["gpu"]), None)
    rows = args.batch * 197
    print(f"{env} rows={rows} bf16 activations, fp32 params; HBM ceiling {ceiling} TB/s")
    print(f"{'case':32s} {'fwd ms: triton eager compile':>30s} {'fwd+bwd ms: triton eager compile':>34s} "
          f"{'GB/s fwd':>9s} {'fwd+bwd':>8s}")
    results = []
    for case in cases(rows):
        r = time_case(case, rows)
        results.append(r)
        print(f"{r['case']:32s} {r['triton_fwd_ms']:10.3f} {r['eager_fwd_ms']:8.3f} {r['compile_fwd_ms']:8.3f}"
              f"   {r['triton_fwd_bwd_ms']:12.3f} {r['eager_fwd_bwd_ms']:8.3f} {r['compile_fwd_bwd_ms']:8.3f}"
              f"   {r['fwd_GBps']:9.0f} {r['fwd_bwd_GBps']:8.0f}", flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"env": env, "hbm_TBps": ceiling, "results": results}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
