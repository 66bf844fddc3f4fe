"""The eager baseline of kernels/linear_act.py (the MLP: fc1 + bias + activation, then fc2 without its bias, which
the residual join adds), shared by bench/test_bench_linear_act.py (pytest-benchmark) and the campaign's
micro-benchmarks (vit_fast/tools/campaign.py); importable without pytest."""
import torch.nn.functional as F


def eager_mlp(x, w1, b1, w2, activation="gelu"):
    """cuBLAS GEMMs with a separate activation kernel: what timm's Mlp runs (under autocast: weights cast to x's
    dtype)."""
    u = F.linear(x, w1.to(x.dtype), None if b1 is None else b1.to(x.dtype))
    h = u * (1.702 * u).sigmoid() if activation == "quick_gelu" else F.gelu(
        u, approximate="tanh" if activation == "gelu_tanh" else "none")
    return F.linear(h, w2.to(x.dtype))
