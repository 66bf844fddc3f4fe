"""pytest-benchmark view of bench/bench_norm_gelu.py: forward+backward of each LayerNorm / GELU
function at ViT-B/16 shapes (64 images x 197 tokens, bf16). GPU-only; no timing is asserted.

    pytest bench/test_bench_norm_gelu.py --benchmark-only
"""
import pytest
import torch

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(),
                                reason="GPU-only benchmark: needs CUDA (the kernels are tested on CPU in tests/)")

ROWS = 64 * 197


def _case_names():
    return ["layer_norm", "add_layer_norm", "add_layer_norm+bias+gamma", "bias_gelu", "bias_gelu_tanh",
            "bias_dropout_add p=0.1+gamma"]


@pytest.mark.parametrize("impl", ["triton", "eager"])
@pytest.mark.parametrize("name", _case_names())
def test_fwd_bwd(benchmark, name, impl):
    from bench.bench_norm_gelu import _outputs, cases

    case = next(c for c in cases(ROWS) if c.name == name)
    fn = case.kernel if impl == "triton" else case.eager
    inputs = case.make()
    leaves = [v for v in inputs.values() if isinstance(v, torch.Tensor) and v.requires_grad]
    grads = [torch.randn_like(o) for o in _outputs(fn(**inputs))]

    def step():
        torch.autograd.grad(_outputs(fn(**inputs)), leaves, grads)
        torch.cuda.synchronize()

    step()  # compile / warm up outside the timed rounds
    benchmark.pedantic(step, rounds=20, iterations=5, warmup_rounds=2)
