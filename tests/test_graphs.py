"""The captured training step's rules (vit_fast/training/graphs.py). Capture itself needs a CUDA device: on a GPU
the last test captures a tiny fused model's step and checks that replays train exactly as the eager step does."""
import pytest
import torch
import torch.nn.functional as F

import vit_fast
from vit_fast.kernels import _utils
from vit_fast.training.graphs import CudaGraphStep, check_capturable

from .numerics import DEVICE


def tiny(device="cpu", **kw):
    torch.manual_seed(0)
    return vit_fast.create_model("vit_tiny_patch16_224", img_size=32, depth=1, num_classes=10, **kw).to(device)


def test_cpu_model_is_refused_with_the_device_named():
    model = tiny()
    opt = torch.optim.AdamW(model.parameters(), capturable=True)
    with pytest.raises(ValueError, match="CUDA device, got cpu"):
        check_capturable(model, opt, torch.zeros(2, 3, 32, 32))


def test_optimizer_without_capturable_is_refused(monkeypatch):
    model = tiny()
    opt = torch.optim.AdamW(model.parameters())
    # the device rule passes when the parameters claim CUDA; the optimizer rule is what fails
    monkeypatch.setattr(torch.Tensor, "device", property(lambda self: torch.device("cuda", 0)))
    with pytest.raises(ValueError, match="capturable=True"):
        check_capturable(model, opt)


def test_fp16_and_zero_warmup_are_refused_before_anything_runs():
    model = tiny()
    opt = torch.optim.AdamW(model.parameters(), capturable=True)
    x, y = torch.zeros(2, 3, 32, 32), torch.zeros(2, dtype=torch.long)
    with pytest.raises(ValueError, match="GradScaler"):
        CudaGraphStep(model, opt, F.cross_entropy, x, y, amp_dtype=torch.float16)
    with pytest.raises(ValueError, match="warmup_steps >= 1"):
        CudaGraphStep(model, opt, F.cross_entropy, x, y, warmup_steps=0)


def test_dropout_seed_is_drawn_on_the_tensors_device_and_follows_manual_seed():
    """The kernels' Philox seed is an int64 tensor drawn on the device of the tensors it serves (a CUDA graph
    replays the draw with the device generator advanced), reproducible by torch.manual_seed."""
    device = torch.device(DEVICE)
    torch.manual_seed(3)
    a = _utils.next_seed(device)
    assert a.device.type == device.type and a.dtype == torch.int64 and a.shape == (1,)
    torch.manual_seed(3)
    assert torch.equal(a, _utils.next_seed(device))
    assert not torch.equal(a, _utils.next_seed(device))


@pytest.mark.skipif(DEVICE != "cuda", reason="CUDA-graph capture needs a CUDA device")
def test_captured_step_trains_like_the_eager_step():
    x = torch.randn(4, 3, 32, 32, device=DEVICE)
    y = torch.randint(0, 10, (4,), device=DEVICE)
    eager, captured = tiny(DEVICE, backend="triton"), tiny(DEVICE, backend="triton")
    opt_e = torch.optim.AdamW(eager.parameters(), lr=1e-3, capturable=True)
    opt_c = torch.optim.AdamW(captured.parameters(), lr=1e-3, capturable=True)
    step = CudaGraphStep(captured, opt_c, F.cross_entropy, x, y, amp_dtype=None, warmup_steps=2)
    for p_c, p_e in zip(captured.parameters(), eager.parameters()):  # the warm-up steps were undone
        assert torch.equal(p_c, p_e)
    for _ in range(3):
        loss_c = step(x, y).clone()
        loss_e = F.cross_entropy(eager(x).float(), y)
        loss_e.backward()
        opt_e.step()
        opt_e.zero_grad(set_to_none=True)
        torch.testing.assert_close(loss_c, loss_e.detach(), rtol=1e-5, atol=1e-6)
        assert step.outputs.shape == (4, 10)
    with pytest.raises(ValueError, match="drop or pad the last batch"):
        step(x[:2], y[:2])


@pytest.mark.parametrize("extra, named", [(["--accum-steps", "2"], "--accum-steps 2"), (["--amp", "fp16"], "fp16"),
                                          (["--compile"], "--compile")])
def test_train_cuda_graph_refuses_what_a_graph_cannot_replay(extra, named, capsys):
    from vit_fast.training.train import resolve_args

    with pytest.raises(SystemExit):
        resolve_args(["--cuda-graph", *extra])
    assert "--cuda-graph: not with" in capsys.readouterr().err and named


@pytest.mark.skipif(DEVICE == "cuda",
                    reason="checks the refusal on a machine without CUDA; on a GPU the run itself is tested below")
def test_train_cuda_graph_on_cpu_names_the_need(tmp_path):
    from vit_fast.training.train import resolve_args, train

    args = resolve_args(["--cuda-graph", "--epochs", "1", "--output-dir", str(tmp_path), "--backend", "torch",
                         "--no-progress"])
    with pytest.raises(ValueError, match="--cuda-graph needs one process on a CUDA device"):
        train(args)


@pytest.mark.skipif(DEVICE != "cuda", reason="CUDA-graph capture needs a CUDA device")
def test_train_cuda_graph_runs_and_learns(tmp_path):
    from vit_fast.training.train import resolve_args, train

    summary = train(resolve_args(["--cuda-graph", "--epochs", "1", "--amp", "bf16", "--output-dir", str(tmp_path),
                                  "--no-progress"]))
    assert summary["steps"] > 0 and summary["train_loss"] < 2.3


@pytest.mark.skipif(DEVICE != "cuda", reason="CUDA-graph capture needs a CUDA device")
def test_captured_dropout_draws_fresh_masks_on_every_replay():
    """Attention and projection dropout inside a captured forward: each replay draws its own masks (the seeds
    are device draws the graph replays with the generator advanced), none is replayed from the capture."""
    torch.manual_seed(0)
    blk = vit_fast.Block(64, 4, proj_drop=0.2, attn_drop=0.1, backend="triton").to(DEVICE).train()
    x = torch.randn(2, 17, 64, device=DEVICE)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.no_grad(), torch.cuda.stream(side):
        for _ in range(2):  # compile and tune outside the capture
            blk(x)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.no_grad(), torch.cuda.graph(graph):
        out = blk(x)
    graph.replay()
    first = out.clone()
    graph.replay()
    assert torch.isfinite(out).all() and not torch.equal(out, first)
