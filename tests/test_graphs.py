"""The captured training step's rules (vit_fast/training/graphs.py). Capture itself needs a CUDA device: on a GPU
the last test captures a tiny fused model's step and checks that replays train exactly as the eager step does."""
import pytest
import torch
import torch.nn.functional as F

import vit_fast
from vit_fast.kernels import _utils
from vit_fast.training.graphs import CudaGraphStep, check_capturable, restore_capturable

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


def _parameters_claim_cuda(monkeypatch):
    """The device rule passes when the parameters claim CUDA (other tensors keep their own device)."""
    real = torch.Tensor.device
    monkeypatch.setattr(torch.Tensor, "device", property(
        lambda self: torch.device("cuda", 0) if isinstance(self, torch.nn.Parameter) else real.__get__(self)))


@pytest.mark.parametrize("make", [torch.optim.NAdam, torch.optim.ASGD, torch.optim.Rprop,
                                  lambda params, capturable: torch.optim.SGD(params, lr=0.1)],
                         ids=["NAdam", "ASGD", "Rprop", "SGD"])
def test_optimizers_whose_fresh_state_is_not_zeros_are_refused(monkeypatch, make):
    """The warm-up's optimizer state is reset to zeros after capture: NAdam (mu_product starts at 1), ASGD (eta at
    the learning rate) and Rprop (step sizes at the learning rate) would start from a wrong state; torch's SGD has
    no capturable step."""
    model = tiny()
    opt = make(model.parameters(), capturable=True)
    _parameters_claim_cuda(monkeypatch)
    with pytest.raises(ValueError, match="Adam, AdamW, Adamax, RAdam, RMSprop"):
        check_capturable(model, opt)


def test_a_learning_rate_tensor_off_the_device_is_refused(monkeypatch):
    """A CPU learning-rate tensor is read once, at capture: a schedule would never reach the replays."""
    model = tiny()
    opt = torch.optim.AdamW(model.parameters(), lr=torch.tensor(1e-3), capturable=True)
    _parameters_claim_cuda(monkeypatch)
    with pytest.raises(ValueError, match="learning rate as a float or a tensor on cuda:0, got a tensor on cpu"):
        check_capturable(model, opt)


def test_restore_capturable_after_loading_an_eager_checkpoint():
    """`vit-fast train --resume --cuda-graph` from any checkpoint: torch.distributed.checkpoint's
    set_optimizer_state_dict installs the checkpoint's groups (capturable=False and a float lr from an eager run; a
    CPU lr tensor from a graph run's cpu_offload); restore_capturable makes every group capturable with its own lr
    tensor on the device, the loaded value in it, and the step counters float32 beside their parameters."""
    from torch.distributed.checkpoint.state_dict import (
        StateDictOptions,
        get_optimizer_state_dict,
        set_optimizer_state_dict,
    )

    for saved_lr in (1e-3, torch.tensor(1e-3)):  # an eager run's checkpoint, a graph run's
        model = tiny()
        groups = [{"params": [model.head.weight], "weight_decay": 0.05}, {"params": [model.head.bias]}]
        opt = torch.optim.AdamW(groups, lr=saved_lr, foreach=False)
        sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda step: 0.5 ** step)
        model(torch.randn(2, 3, 32, 32)).sum().backward()
        opt.step()
        sched.step()
        saved = get_optimizer_state_dict(model, opt, options=StateDictOptions(full_state_dict=True, cpu_offload=True))

        model.zero_grad(set_to_none=True)
        # capturable=False: a capturable step needs CUDA parameters, and loading first takes a step on CPU here
        resumed = torch.optim.AdamW([{"params": [model.head.weight], "weight_decay": 0.05},
                                     {"params": [model.head.bias]}], lr=torch.tensor(1.0), foreach=False)
        torch.optim.lr_scheduler.LambdaLR(resumed, lambda step: 0.5 ** step)  # built before loading, as train.py
        set_optimizer_state_dict(model, resumed, saved, options=StateDictOptions(full_state_dict=True))
        restore_capturable(resumed, "cpu")
        lrs = [g["lr"] for g in resumed.param_groups]
        assert all(g["capturable"] is True for g in resumed.param_groups)
        assert all(isinstance(lr, torch.Tensor) and lr.device.type == "cpu" and lr.dtype == torch.float32
                   and lr.item() == pytest.approx(5e-4) for lr in lrs)
        assert lrs[0] is not lrs[1]  # each group's own, as a scheduler fills each
        for p in (model.head.weight, model.head.bias):
            step = resumed.state[p]["step"]
            assert step.dtype == torch.float32 and step.device == p.device and step.item() == 1


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


@pytest.mark.skipif(DEVICE != "cuda", reason="CUDA-graph capture needs a CUDA device")
def test_captured_step_with_dropout_draws_the_eager_steps_masks():
    """Dropout, attention dropout and drop-path inside the captured step: its warm-up's random draws are undone, so
    from one torch.manual_seed the replays draw, step after step, the masks the eager steps draw."""
    drops = dict(proj_drop_rate=0.2, attn_drop_rate=0.1, drop_path_rate=0.2, backend="triton")
    x = torch.randn(4, 3, 32, 32, device=DEVICE)
    y = torch.randint(0, 10, (4,), device=DEVICE)
    eager, captured = tiny(DEVICE, **drops).train(), tiny(DEVICE, **drops).train()
    opt_e = torch.optim.AdamW(eager.parameters(), lr=1e-3, capturable=True)
    opt_c = torch.optim.AdamW(captured.parameters(), lr=1e-3, capturable=True)
    torch.manual_seed(123)
    step = CudaGraphStep(captured, opt_c, F.cross_entropy, x, y, amp_dtype=None, warmup_steps=2)
    losses_c = [step(x, y).clone() for _ in range(3)]
    torch.manual_seed(123)
    losses_e = []
    for _ in range(3):
        loss = F.cross_entropy(eager(x).float(), y)
        loss.backward()
        opt_e.step()
        opt_e.zero_grad(set_to_none=True)
        losses_e.append(loss.detach())
    assert len({round(v.item(), 6) for v in losses_c}) == 3  # fresh masks (and weights) each replay
    torch.testing.assert_close(torch.stack(losses_c), torch.stack(losses_e), rtol=1e-5, atol=1e-6)


@pytest.mark.skipif(DEVICE != "cuda", reason="CUDA-graph capture needs a CUDA device")
def test_a_schedule_reaches_the_captured_step_through_the_lr_tensor():
    """The learning rate (and with it AdamW's weight decay) is read from its device tensor at every replay: filled
    with 0 the replay leaves the weights as they are, filled back it trains."""
    x = torch.randn(4, 3, 32, 32, device=DEVICE)
    y = torch.randint(0, 10, (4,), device=DEVICE)
    model = tiny(DEVICE, backend="triton")
    lr = torch.tensor(1e-3, device=DEVICE)
    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.1, capturable=True)
    step = CudaGraphStep(model, opt, F.cross_entropy, x, y, amp_dtype=None, warmup_steps=1)
    before = [p.detach().clone() for p in model.parameters()]
    lr.fill_(0.0)
    step(x, y)
    assert all(torch.equal(p, b) for p, b in zip(model.parameters(), before))
    lr.fill_(1e-3)
    step(x, y)
    assert not all(torch.equal(p, b) for p, b in zip(model.parameters(), before))


@pytest.mark.skipif(DEVICE != "cuda", reason="CUDA-graph capture needs a CUDA device")
def test_train_cuda_graph_resumed_equals_the_uninterrupted_run(tmp_path):
    """`vit-fast train --cuda-graph`, stopped and resumed (the checkpoint's optimizer put back on the device, its
    learning rate a tensor the schedule fills), ends with the weights of the run that was not interrupted."""
    from vit_fast.training import checkpoint as ckpt
    from vit_fast.training.train import resolve_args, train

    tiny_run = ["--cuda-graph", "--dataset", "digits", "--img-size", "16", "--patch-size", "4", "--depth", "2",
                "--embed-dim", "32", "--num-heads", "2", "--batch-size", "32", "--epochs", "1", "--warmup-epochs",
                "0.2", "--lr", "3e-3", "--amp", "bf16", "--drop-path-rate", "0.2", "--no-progress", "--no-plot",
                "--ckpt-every", "1000", "--stop-at-step", "12"]
    whole = train(resolve_args([*tiny_run, "--output-dir", str(tmp_path / "whole")]))
    train(resolve_args([*tiny_run[:-1], "5", "--output-dir", str(tmp_path / "parts")]))
    resumed = train(resolve_args([*tiny_run, "--output-dir", str(tmp_path / "parts"), "--resume", "auto"]))
    assert whole["steps"] == resumed["steps"] == 12
    a = ckpt.read_weights(ckpt.resolve_checkpoint(tmp_path / "whole"))
    b = ckpt.read_weights(ckpt.resolve_checkpoint(tmp_path / "parts"))
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


@pytest.mark.parametrize("extra, named", [(["--accum-steps", "2"], "--accum-steps 2"), (["--amp", "fp16"], "fp16"),
                                          (["--compile"], "--compile")])
def test_train_cuda_graph_refuses_what_a_graph_cannot_replay(extra, named, capsys):
    from vit_fast.training.train import resolve_args

    with pytest.raises(SystemExit):
        resolve_args(["--cuda-graph", *extra])
    err = capsys.readouterr().err
    assert "--cuda-graph: not with" in err and named in err


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
