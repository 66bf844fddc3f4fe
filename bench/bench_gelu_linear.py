"""The eager baseline of kernels/gelu_linear.py (the MLP's GELU and fc2), shared by bench/test_bench_gelu_linear.py
(pytest-benchmark) and the campaign's micro-benchmarks (vit_fast/tools/campaign.py); importable without pytest."""
import torch.nn.functional as F


def eager_gelu_linear(h, bias, weight, approximate="none"):
    g = F.gelu(h + bias, approximate=approximate).to(h.dtype)  # bias fp32 under autocast: GELU in fp32
    return F.linear(g, weight.to(h.dtype))
