"""`vit-fast train` (vit_fast/train.py, vit_fast/checkpoint.py): resume bit for bit, DDP, signals, refusals.

Tiny runs: digits at 16 px, patch 4 (17 tokens), 2 blocks of width 32, global batch 32 -> 44 steps per
epoch, the reference backend, 1 CPU thread. Each in-process run takes a second or two.
"""
import itertools
import json
import os
import shutil
import signal
import subprocess
import sys
import time
import types
from pathlib import Path

import pytest
import torch

from tests.numerics import assert_close
from vit_fast.training import checkpoint as ckpt
from vit_fast.training import train as vt

ROOT = Path(__file__).resolve().parents[1]
TINY = ["--dataset", "digits", "--img-size", "16", "--patch-size", "4", "--depth", "2", "--embed-dim", "32",
        "--num-heads", "2", "--batch-size", "32", "--epochs", "2", "--warmup-epochs", "0.5", "--lr", "3e-3",
        "--backend", "torch", "--no-progress", "--no-plot", "--log-every", "5", "--threads", "1"]
STEPS = 88   # 2 epochs of 1438 // 32 steps


def run(out, *extra):
    return vt.main([*TINY, "--output-dir", str(out), *extra])


def final_weights(out):
    return ckpt.read_weights(ckpt.resolve_checkpoint(out))


def subprocess_env():
    return {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """Uninterrupted runs: with drop-path (exercises the RNG) and without (comparable across world sizes)."""
    out = tmp_path_factory.mktemp("reference")
    summary = run(out / "droppath", "--drop-path-rate", "0.2", "--ckpt-every", "1000")
    plain = run(out / "plain", "--ckpt-every", "30", "--keep-checkpoints", "5")
    assert summary["steps"] == plain["steps"] == STEPS and not summary["stopped_early"]
    return out


def test_interrupted_and_resumed_equals_uninterrupted_bitwise(reference, tmp_path):
    stopped = run(tmp_path, "--drop-path-rate", "0.2", "--stop-at-step", "30", "--ckpt-every", "1000")
    assert stopped["stopped_early"] and stopped["steps"] == 30
    assert ckpt.resolve_checkpoint(tmp_path).name == "step_00000030"
    resumed = run(tmp_path, "--drop-path-rate", "0.2", "--resume", "auto", "--ckpt-every", "1000")
    assert resumed["steps"] == STEPS
    ref, got = final_weights(reference / "droppath"), final_weights(tmp_path)
    assert ref.keys() == got.keys() and all(torch.equal(ref[k], got[k]) for k in ref)
    ref_opt = ckpt.read_state(ckpt.resolve_checkpoint(reference / "droppath"))["optimizer"]["state"]
    got_opt = ckpt.read_state(ckpt.resolve_checkpoint(tmp_path))["optimizer"]["state"]
    assert all(torch.equal(ref_opt[k]["exp_avg_sq"], got_opt[k]["exp_avg_sq"]) for k in ref_opt)
    # the metrics file reads as one run: no step logged twice, evaluations for both epochs
    records = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    train_steps = [r["step"] for r in records if r["kind"] == "train"]
    assert train_steps == sorted(set(train_steps)) and [r["epoch"] for r in records if r["kind"] == "eval"] == [1, 2]
    assert resumed["test_acc"] == pytest.approx(final_summary(reference / "droppath")["test_acc"])


def final_summary(out):
    return json.loads((out / "summary.json").read_text())


def test_checkpoint_contents_load_weights_only(reference):
    ckpt_dir = ckpt.resolve_checkpoint(reference / "plain")
    state = torch.load(ckpt_dir / ckpt.STATE, weights_only=True)   # no pickled code needed
    assert state["step"] == STEPS and state["world_size"] == 1 and state["args"]["embed_dim"] == 32
    assert state["model_config"]["embed_dim"] == 32 and state["rng"][0]["torch"].dtype == torch.uint8
    assert set(state) >= {"optimizer", "scheduler", "scaler", "rng", "last_eval_epoch", "best_acc"}
    names = [p.name for p in ckpt.list_checkpoints(reference / "plain" / "checkpoints")]
    assert names == ["step_00000030", "step_00000044", "step_00000060", "step_00000088"]   # every 30 + epoch ends
    # no-decay group: 1-D parameters and no_weight_decay() names
    groups = state["optimizer"]["param_groups"]
    no_decay = next(g["params"] for g in groups if g["weight_decay"] == 0.0)
    assert {"pos_embed", "cls_token", "blocks.0.norm1.weight", "blocks.0.attn.qkv.bias"} <= set(no_decay)
    assert "blocks.0.attn.qkv.weight" not in no_decay
    assert (reference / "plain" / "summary.json").is_file() and (reference / "plain" / "args.json").is_file()


def test_mismatched_checkpoint_is_refused(reference):
    with pytest.raises(ValueError, match=r"embed_dim: checkpoint 32, this run 48"):
        vt.main([*TINY, "--embed-dim", "48", "--output-dir", str(reference / "plain"), "--resume", "auto"])
    with pytest.raises(ValueError, match="--batch-size 64 differs"):
        vt.main([*TINY, "--batch-size", "64", "--resume", str(reference / "plain")])


def test_incomplete_checkpoints_are_ignored(reference, tmp_path):
    root = tmp_path / "checkpoints"
    good = ckpt.resolve_checkpoint(reference / "plain")
    ckpt.write_checkpoint(root, 5, ckpt.read_weights(good), {"x": torch.ones(2)})
    (root / "step_00000009.tmp").mkdir()                    # killed while writing
    (root / "step_00000010").mkdir()                        # incomplete: no state.pt
    (root / "step_00000010" / ckpt.WEIGHTS).write_bytes(b"")
    assert ckpt.latest_checkpoint(root).name == "step_00000005"
    (root / ckpt.LATEST).write_text("step_00000010\n")      # a stale pointer is not trusted either
    assert ckpt.latest_checkpoint(root).name == "step_00000005"
    assert ckpt.read_state(root / "step_00000005")["step"] == 5
    with pytest.raises(FileNotFoundError, match="no complete checkpoint"):
        ckpt.resolve_checkpoint(tmp_path / "nothing")


def free_port() -> int:
    """A port no other process holds now (a fixed one collides with a concurrent or lingering run)."""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_ddp_two_processes_match_single_and_resume_in_one_process(reference, tmp_path):
    """torchrun, 2 gloo ranks x 2 accumulated micro-batches of 8 (no_sync on the first) == 1 process with
    batch 32; the DDP checkpoint then resumes in one process without accumulation."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port", str(free_port()),
           "-m", "vit_fast.training.train", *TINY, "--output-dir", str(tmp_path), "--stop-at-step", "30",
           "--ckpt-every", "1000", "--accum-steps", "2"]
    proc = subprocess.run(cmd, cwd=tmp_path, env=subprocess_env(), capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    assert "2 process(es)" in proc.stdout and proc.stdout.count("stopped at step 30") == 1   # rank 0 prints
    ddp_state = ckpt.read_state(ckpt.resolve_checkpoint(tmp_path))
    assert ddp_state["world_size"] == 2 and len(ddp_state["rng"]) == 2
    single = ckpt.read_weights(ckpt.list_checkpoints(reference / "plain" / "checkpoints")[0])   # step 30
    compare_weights(final_weights(tmp_path), single, rtol=1e-5, what="DDP vs single")
    resumed = run(tmp_path, "--resume", "auto", "--ckpt-every", "1000")
    assert resumed["steps"] == STEPS and resumed["world_size"] == 1
    compare_weights(final_weights(tmp_path), final_weights(reference / "plain"), rtol=1e-4,
                    what="DDP-resumed vs single")


def test_fsdp2_resumes_a_single_process_checkpoint_and_matches(reference, tmp_path):
    """torchrun --fsdp (fully_shard per block, 2 gloo ranks) continues the single run's step-30 checkpoint to
    the end of epoch 1 (evaluation included), saving a gathered full checkpoint equal to the single run's."""
    plain = ckpt.list_checkpoints(reference / "plain" / "checkpoints")
    cmd = [sys.executable, "-m", "vit_fast.training.train", *TINY, "--fsdp", "--output-dir", str(tmp_path),
           "--resume", str(plain[0]), "--stop-at-step", "45", "--ckpt-every", "1000"]
    # the two ranks are started with torchrun's environment directly (the DDP test goes through torchrun):
    # one Python start-up less
    env = {**subprocess_env(), "WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port())}
    procs = [subprocess.Popen(cmd, cwd=tmp_path, env={**env, "RANK": str(r), "LOCAL_RANK": str(r)},
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for r in range(2)]
    outputs = [p.communicate(timeout=300) for p in procs]
    for p, (out, err) in zip(procs, outputs):
        assert p.returncode == 0, out[-2000:] + err[-3000:]
    out = outputs[0][0]
    assert "2 process(es)" in out and "resumed from" in out and "epoch 1/2: step 44" in out and not outputs[1][0]
    assert [p.name for p in ckpt.list_checkpoints(tmp_path / "checkpoints")] == ["step_00000044", "step_00000045"]
    compare_weights(ckpt.read_weights(tmp_path / "checkpoints" / "step_00000044"), ckpt.read_weights(plain[1]),
                    rtol=1e-5, what="FSDP2 vs single")
    evals = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    single_evals = [json.loads(line) for line in (reference / "plain" / "metrics.jsonl").read_text().splitlines()]
    acc = [r["test_acc"] for r in evals if r["kind"] == "eval"]
    assert acc == [pytest.approx(next(r["test_acc"] for r in single_evals if r["kind"] == "eval"), abs=0.01)]


def compare_weights(got, ref, rtol, what):
    """Same data and math; only the order of the gradient sums differs (DDP all-reduce), so fp32 rounding.

    Except the attention key biases: their true gradient is exactly 0 (softmax ignores a shift shared
    by all keys), so they receive only rounding noise, which Adam normalises into updates of noise
    direction. Both runs must keep them near 0; they are compared apart from the rest.
    """
    assert got.keys() == ref.keys()
    for name in ref:
        a, b = got[name].clone(), ref[name].clone()
        if name.endswith("attn.qkv.bias"):
            dim = a.numel() // 3
            assert a[dim:2 * dim].abs().max() < 1e-3 and b[dim:2 * dim].abs().max() < 1e-3, name
            a[dim:2 * dim] = b[dim:2 * dim] = 0
        assert_close(a, b, rtol=rtol, name=f"{what}: {name}")


def test_sigterm_finishes_the_step_checkpoints_and_exits_0(tmp_path):
    cmd = [sys.executable, "-m", "vit_fast.training.train", *TINY, "--epochs", "100", "--output-dir", str(tmp_path),
           "--ckpt-every", "100000"]
    proc = subprocess.Popen(cmd, cwd=tmp_path, env=subprocess_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True)
    metrics, deadline = tmp_path / "metrics.jsonl", time.time() + 90
    while time.time() < deadline and proc.poll() is None:
        if metrics.is_file() and '"train"' in metrics.read_text():   # training is under way
            break
        time.sleep(0.2)
    proc.send_signal(signal.SIGTERM)
    out, err = proc.communicate(timeout=60)
    assert proc.returncode == 0, err[-3000:]
    assert "SIGTERM" in err and "stopped at step" in out
    state = ckpt.read_state(ckpt.resolve_checkpoint(tmp_path))
    assert 5 <= state["step"] < 100 * 44
    again = run(tmp_path, "--epochs", "100", "--resume", "auto", "--stop-at-step", str(state["step"] + 3))
    assert again["steps"] == state["step"] + 3


def test_resumed_run_rates_count_only_its_own_steps(tmp_path, monkeypatch, capsys):
    """Resumed at step 82 (mid-window, --log-every 5): the done line counts the 6 steps this process ran (not the
    run's 88) and the step-85 record's img/s the 3 steps timed here (not the 2 carried in the window from the earlier
    run). A clock that ticks 1 s per read makes a window 1 s long."""
    run(tmp_path, "--stop-at-step", "82")
    ticks = itertools.count()
    monkeypatch.setattr(vt, "time", types.SimpleNamespace(perf_counter=lambda: float(next(ticks)),
                                                          strftime=time.strftime))
    capsys.readouterr()
    resumed = run(tmp_path, "--resume", "auto")
    done = next(line for line in capsys.readouterr().out.splitlines() if line.startswith("done:"))
    assert f"6 steps (resumed at step 82, now {STEPS}) in" in done
    assert f"({6 / resumed['train_seconds']:.1f} steps/s, " in done
    records = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    step_85 = next(r for r in records if r["kind"] == "train" and r["step"] == 85)
    assert step_85["img_per_s"] == 3 * 32


def test_fsdp_outside_torchrun_is_argparses_error(monkeypatch, capsys):
    """--fsdp without torchrun's RANK / WORLD_SIZE: a usage error naming the launch it expects, before any
    data loads."""
    monkeypatch.delenv("RANK", raising=False)
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    with pytest.raises(SystemExit) as exit_info:
        vt.cli_main(["--fsdp", *TINY])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert "vit-fast train: error: argument --fsdp: expected a launch by torchrun" in err
    assert "torchrun --nproc_per_node N -m vit_fast.training.train" in err


@pytest.mark.parametrize("amp", ["bf16", "fp16"])
def test_amp_and_gradient_accumulation(tmp_path, amp):
    extra = ["--grad-checkpointing", "--bf16-residual"] if amp == "bf16" else []
    summary = run(tmp_path, "--amp", amp, "--accum-steps", "2", "--stop-at-step", "6", "--log-every", "3", *extra)
    assert summary["steps"] == 6 and 0 < summary["train_loss"] < 3
    state = ckpt.read_state(ckpt.resolve_checkpoint(tmp_path))
    weights = final_weights(tmp_path)
    assert all(torch.isfinite(w).all() and w.dtype == torch.float32 for w in weights.values())
    assert (state["scaler"].get("scale", 0) > 0) == (amp == "fp16")   # GradScaler only for fp16
    assert state["model_config"]["residual_in_fp32"] == (amp == "fp16")  # --bf16-residual with bf16


def test_lr_schedule_warmup_then_cosine():
    f = vt.warmup_cosine(warmup_steps=10, total_steps=110, min_ratio=0.01)
    assert f(0) == pytest.approx(1 / 11) and f(9) == pytest.approx(10 / 11) and f(10) == pytest.approx(1.0)
    assert f(60) == pytest.approx(0.01 + 0.99 * 0.5) and f(110) == pytest.approx(0.01)
    assert all(f(s) >= f(s + 1) for s in range(10, 120))


def test_init_from_file_adapts_head_grid_and_channels(tmp_path):
    import vit_fast

    source = vit_fast.create_model("vit_tiny_patch16_224", img_size=32, patch_size=4, depth=2, embed_dim=32,
                                   num_heads=2, num_classes=5)
    vit_fast.save_checkpoint(source, tmp_path / "src.safetensors")
    model = vit_fast.create_model("vit_tiny_patch16_224", img_size=16, patch_size=4, in_chans=1, depth=2,
                                  embed_dim=32, num_heads=2, num_classes=10)
    head_before = model.head.weight.clone()
    notes = ckpt.load_pretrained(model, f"file:{tmp_path / 'src.safetensors'}")
    assert len(notes) == 4 and torch.equal(model.head.weight, head_before)
    assert torch.equal(model.blocks[1].mlp.fc2.weight, source.blocks[1].mlp.fc2.weight)
    assert torch.equal(model.patch_embed.proj.weight, source.patch_embed.proj.weight.sum(1, keepdim=True))
    assert model.pos_embed.shape == (1, 17, 32)
    summary = run(tmp_path / "run", "--init-from", f"file:{tmp_path / 'src.safetensors'}", "--stop-at-step", "2")
    assert summary["steps"] == 2


def test_init_from_hub_name_fails_fast_offline():
    start = time.time()
    with pytest.raises(ValueError, match="not in the local Hugging Face cache"):
        ckpt.pretrained_state_dict("timm:vit_tiny_patch16_224.no_such_tag_in_cache")
    assert time.time() - start < 60
    with pytest.raises(ValueError, match="expected timm:NAME"):
        ckpt.pretrained_state_dict("vit_tiny_patch16_224")


def test_imagefolder_run_skips_a_corrupt_image(tmp_path, caplog):
    import logging

    from tests.test_data import _write_image_tree

    _write_image_tree(tmp_path / "data")
    args = ["--dataset", "imagefolder", "--data-dir", str(tmp_path / "data"), "--img-size", "16", "--patch-size", "8",
            "--depth", "1", "--embed-dim", "32", "--num-heads", "2", "--batch-size", "6", "--epochs", "1",
            "--workers", "0", "--backend", "torch", "--no-progress", "--output-dir", str(tmp_path / "run")]
    with caplog.at_level(logging.WARNING, logger="vit_fast.training.data"):
        summary = vt.main(args)
    assert summary["steps"] == 1 and not summary["stopped_early"]
    assert str(tmp_path / "data" / "val" / "cat" / "1_broken.png") in caplog.text
    evals = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [r["test_count"] for r in evals if r["kind"] == "eval"] == [6]   # 7 files, 6 readable
    assert (tmp_path / "run" / "curves.png").stat().st_size > 1000          # the plot is written


def test_triton_backend_without_gpu_or_interpreter_is_refused_early(tmp_path, monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    with pytest.raises(ValueError, match="--backend triton needs a CUDA device"):
        vt.main([*TINY, "--backend", "triton", "--output-dir", str(tmp_path)])
    assert vt.cli_main([*TINY, "--batch-size", "33", "--accum-steps", "2", "--output-dir", str(tmp_path)]) == 2


def test_fused_backend_trains_like_the_reference(tmp_path, monkeypatch):
    """A few steps on the Triton kernels (interpreter on CPU) follow the reference run's losses."""
    from vit_fast.kernels.layer_norm import add_layer_norm_fwd

    joins = []  # the residual joins fused with a LayerNorm (a residual given), per part or in a one-Function block
    fused_join = add_layer_norm_fwd.function  # what both paths call on plain tensors (run_op)

    def counted(x, residual, *args):
        joins.extend([1] if residual is not None else [])
        return fused_join(x, residual, *args)

    monkeypatch.setattr(add_layer_norm_fwd, "function", counted)
    steps = ["--batch-size", "8", "--stop-at-step", "3", "--log-every", "1", "--drop-path-rate", "0.1"]

    def losses(backend):
        args = [a if a != "torch" else backend for a in TINY]  # TINY asks for --backend torch
        vt.main([*args, *steps, "--output-dir", str(tmp_path / backend)])
        rows = [json.loads(line) for line in (tmp_path / backend / "metrics.jsonl").read_text().splitlines()]
        return torch.tensor([r["loss"] for r in rows if r["kind"] == "train"])

    ref = losses("torch")
    assert not joins
    fused = losses("triton")
    # every residual join but the last (followed by fc_norm: bias_dropout_add) ran fused, in every step
    assert len(ref) == 3 and len(joins) == 3 * (2 * 2 - 1)
    assert_close(fused, ref, 1e-5, name="train losses")


# ------------------------------------------------------------------------------------------ kill -9 and resume
# A training subprocess that SIGKILLs itself at a chosen point (no signal handler, no cleanup: as kill -9):
#   step:N      inside the N-th training forward (mid-step, before backward / optimizer step)
#   save:N      while the N-th torch.save (state.pt) is writing: the file is left half-written in step_N.tmp
#   pointer:N   after the N-th checkpoint directory is in place, before the `latest` pointer is updated
#   eval:N      at the N-th evaluation (eval:2 with a checkpoint at the last step: after it, before the final eval)
KILLER = r"""
import os, signal, sys
import torch
from vit_fast.training import checkpoint as ckpt, train as vt

point, n = sys.argv[1].split(":"); n = int(n); calls = [0]
def due():
    calls[0] += 1
    return calls[0] == n
def die():
    os.kill(os.getpid(), signal.SIGKILL)
if point == "step":
    build = vt.build_model
    def build_model(*a, **k):
        model = build(*a, **k)
        model.register_forward_hook(lambda m, i, o: die() if m.training and due() else None)
        return model
    vt.build_model = build_model
elif point == "save":
    save = torch.save
    def half_save(obj, f, *a, **k):
        save(obj, f, *a, **k)
        if due():
            data = open(f, "rb").read()
            open(f, "wb").write(data[:len(data) // 2])
            die()
    torch.save = half_save
elif point == "pointer":
    replace = ckpt._replace_text
    ckpt._replace_text = lambda *a: die() if due() else replace(*a)
elif point == "eval":
    evaluate = vt.evaluate
    vt.evaluate = lambda *a: die() if due() else evaluate(*a)
vt.main(sys.argv[2:])
raise SystemExit("not killed")
"""
DROPPATH = ["--drop-path-rate", "0.2"]
DETERMINISTIC = ("steps", "total_steps", "epochs", "stopped_early", "train_loss", "test_acc", "test_loss",
                 "best_test_acc", "world_size")


def metric_records(out):
    """metrics.jsonl without the timings."""
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    return [{k: v for k, v in r.items() if k != "img_per_s"} for r in rows]


def assert_same_run(out, ref):
    """Weights, optimizer state, scheduler, summary and metrics file equal to the uninterrupted run's."""
    got_dir, ref_dir = ckpt.resolve_checkpoint(out), ckpt.resolve_checkpoint(ref)
    assert got_dir.name == ref_dir.name == f"step_{STEPS:08d}"
    got, want = ckpt.read_weights(got_dir), ckpt.read_weights(ref_dir)
    assert got.keys() == want.keys() and all(torch.equal(got[k], want[k]) for k in want)
    got_state, want_state = ckpt.read_state(got_dir), ckpt.read_state(ref_dir)
    for name, moments in want_state["optimizer"]["state"].items():
        for key, value in moments.items():
            assert torch.equal(got_state["optimizer"]["state"][name][key], value), (name, key)
    assert got_state["scheduler"] == want_state["scheduler"] and got_state["last_eval_epoch"] == 1
    summary, want_summary = final_summary(out), final_summary(ref)
    assert {k: summary[k] for k in DETERMINISTIC} == {k: want_summary[k] for k in DETERMINISTIC}
    assert summary["train_loss"] is not None and not summary["stopped_early"]
    assert metric_records(out) == metric_records(ref)


@pytest.mark.parametrize("kill", ["step:70", "save:3", "pointer:2", "eval:2"])
def test_sigkill_then_resume_equals_the_uninterrupted_run(reference, tmp_path, kill):
    """Killed mid-step (resumes at step 66, mid-epoch and mid metrics window), while writing state.pt (the
    half-written step_44.tmp is ignored, the earlier step-44 checkpoint without its evaluation is resumed
    and the evaluation runs), between a checkpoint and its `latest` pointer, and after the last step's
    checkpoint before the final evaluation."""
    argv = [*TINY, *DROPPATH, "--ckpt-every", "22", "--output-dir", str(tmp_path)]
    proc = subprocess.run([sys.executable, "-c", KILLER, kill, *argv], cwd=tmp_path, env=subprocess_env(),
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == -signal.SIGKILL, proc.stderr[-3000:]
    assert not (tmp_path / "summary.json").exists()
    if kill == "save:3":
        assert (tmp_path / "checkpoints" / "step_00000044.tmp").is_dir()
    resumed = run(tmp_path, *DROPPATH, "--ckpt-every", "22", "--resume", "auto")
    assert resumed["steps"] == STEPS
    assert_same_run(tmp_path, reference / "droppath")
    again = run(tmp_path, *DROPPATH, "--ckpt-every", "22", "--resume", "auto")   # a finished run resumes to itself
    assert {k: again[k] for k in DETERMINISTIC} == {k: resumed[k] for k in DETERMINISTIC}


def test_stop_at_the_last_step_then_resume_runs_the_final_evaluation(reference, tmp_path):
    """Issue 23 case 2: the state of a kill after the last checkpoint, before the final evaluation."""
    stopped = run(tmp_path, *DROPPATH, "--stop-at-step", str(STEPS))
    assert stopped["stopped_early"] and stopped["steps"] == STEPS
    resumed = run(tmp_path, *DROPPATH, "--resume", "auto")
    assert resumed["test_acc"] == final_summary(reference / "droppath")["test_acc"]
    assert_same_run(tmp_path, reference / "droppath")


@pytest.mark.parametrize("damaged", [ckpt.WEIGHTS, ckpt.STATE])
def test_truncated_newest_checkpoint_falls_back_with_a_warning(reference, tmp_path, caplog, damaged):
    import logging

    shutil.copytree(reference / "droppath", tmp_path, dirs_exist_ok=True)
    newest = ckpt.resolve_checkpoint(tmp_path)
    assert newest.name == f"step_{STEPS:08d}"
    path = newest / damaged
    path.write_bytes(path.read_bytes()[:path.stat().st_size // 2])
    with caplog.at_level(logging.WARNING, logger="vit_fast.training.checkpoint"):
        resumed = run(tmp_path, *DROPPATH, "--resume", "auto")
    assert str(path) in caplog.text and "falling back" in caplog.text
    assert resumed["steps"] == STEPS and (tmp_path / "checkpoints" / f"step_{STEPS:08d}.damaged").is_dir()
    assert_same_run(tmp_path, reference / "droppath")   # resumed from step 44 and re-trained epoch 2


def test_every_checkpoint_damaged_is_an_error_never_a_fresh_start(reference, tmp_path):
    from vit_fast import CheckpointError

    shutil.copytree(reference / "droppath", tmp_path, dirs_exist_ok=True)
    for ckpt_dir in ckpt.list_checkpoints(tmp_path / "checkpoints"):
        (ckpt_dir / ckpt.STATE).write_bytes(b"")
    explicit = ckpt.list_checkpoints(tmp_path / "checkpoints")[0]
    with pytest.raises(CheckpointError, match=rf"{explicit / ckpt.STATE}: 0 bytes, expected \d+"):
        run(tmp_path / "other", "--resume", str(explicit))
    with pytest.raises(CheckpointError, match="no intact checkpoint in .*every one is damaged"):
        run(tmp_path, *DROPPATH, "--resume", "auto")
    assert not ckpt.list_checkpoints(tmp_path / "checkpoints")   # set aside as *.damaged, none deleted
    assert len(list((tmp_path / "checkpoints").glob("*.damaged"))) == 2


def test_manifest_records_size_and_checksum(reference):
    import hashlib

    ckpt_dir = ckpt.resolve_checkpoint(reference / "plain")
    manifest = json.loads((ckpt_dir / ckpt.MANIFEST).read_text())
    for name in (ckpt.WEIGHTS, ckpt.STATE):
        data = (ckpt_dir / name).read_bytes()
        assert manifest["files"][name] == {"size": len(data), "sha256": hashlib.sha256(data).hexdigest()}
    ckpt.verify_checkpoint(ckpt_dir)


def test_checkpoint_without_manifest_is_checked_for_readable_files(reference, tmp_path):
    """Checkpoints written before manifests existed: a truncated file is still found before loading."""
    from vit_fast import CheckpointError

    shutil.copytree(ckpt.resolve_checkpoint(reference / "plain"), tmp_path / "old")
    (tmp_path / "old" / ckpt.MANIFEST).unlink()
    ckpt.verify_checkpoint(tmp_path / "old")
    state = tmp_path / "old" / ckpt.STATE
    state.write_bytes(state.read_bytes()[:-100])
    with pytest.raises(CheckpointError, match=f"{state}: truncated or damaged torch.save file"):
        ckpt.verify_checkpoint(tmp_path / "old")


def test_the_loop_copies_nothing_from_the_host_per_step(tmp_path, monkeypatch):
    """torch.tensor(..., device=...) in the step loop is a host-to-device copy from pageable memory: on a GPU a
    synchronisation per step, which stalls a CUDA-graph run's replays behind the data loading. The loop builds its
    metrics on the device; only the logging steps read them back."""
    real, made = torch.tensor, []

    def spy(*args, **kwargs):
        caller = sys._getframe(1).f_code.co_filename
        if kwargs.get("device") is not None and caller.endswith(os.path.join("training", "train.py")):
            made.append(sys._getframe(1).f_lineno)
        return real(*args, **kwargs)

    monkeypatch.setattr(torch, "tensor", spy)
    summary = run(tmp_path, "--epochs", "1", "--stop-at-step", "6", "--log-every", "3", "--ckpt-every", "1000")
    assert summary["steps"] == 6 and made == []
