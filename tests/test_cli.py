"""`vit-fast` command line: the dispatch table and the `info` subcommand."""
import re
import subprocess
import sys

import pytest

import vit_fast
from vit_fast.tools import cli


def test_every_registered_subcommand_resolves():
    """A "module:function" line in COMMANDS that does not import fails here, not in a user's shell."""
    assert "info" in cli.COMMANDS
    for name, target in cli.COMMANDS.items():
        assert re.fullmatch(r"vit_fast(\.\w+)+:\w+", target), f"{name}: {target!r} is not 'module:function'"
        assert callable(cli.resolve(target)), name


def test_info_prints_params_flops_and_forward(capsys):
    assert cli.main(["info", "--model", "vit_tiny_patch16_224", "--batch", "3", "--img-size", "64"]) == 0
    out = capsys.readouterr().out
    model = vit_fast.create_model("vit_tiny_patch16_224", img_size=64)
    params = int(re.search(r"parameters\s+([\d,]+)", out).group(1).replace(",", ""))
    gflops = float(re.search(r"GFLOPs\s+([\d.]+) per image", out).group(1))
    assert params == vit_fast.count_params(model)
    assert gflops == round(vit_fast.forward_flops(model.config) / 1e9, 2) and "analytic" in out
    assert "logits (3, 1000)" in out and "17 tokens" in out


def test_info_list_and_errors(capsys):
    assert cli.main(["info", "--list"]) == 0
    assert capsys.readouterr().out.split() == vit_fast.list_models()
    assert cli.main(["info", "--model", "vit_nope"]) == 2
    assert "unknown model 'vit_nope'" in capsys.readouterr().err
    with pytest.raises(SystemExit) as exit_info:
        cli.main(["no-such-command"])
    assert exit_info.value.code == 2


def test_module_entry_point_runs_in_a_fresh_process():
    result = subprocess.run([sys.executable, "-m", "vit_fast.tools.cli", "info", "--model", "vit_tiny_patch16_224",
                             "--batch", "1", "--img-size", "32"], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    assert "logits (1, 1000)" in result.stdout


def test_bench_campaign_flags_are_documented(capsys):
    """`vit-fast bench --campaign --out DIR [--dry-run] [--budget S]` (README); the campaign itself is
    driven end to end in tests/test_campaign.py."""
    with pytest.raises(SystemExit) as exit_info:
        cli.main(["bench", "--help"])
    assert exit_info.value.code == 0
    out = capsys.readouterr().out
    assert all(flag in out for flag in ("--campaign", "--dry-run", "--budget", "--out"))


@pytest.mark.parametrize("option, value", [("--models", "vit_nope"), ("--batches", "0"), ("--steps", "0"),
                                           ("--warmup", "-1"), ("--peak-tflops", "-5"), ("--budget", "0")])
def test_bench_checks_its_options_before_saying_there_is_no_gpu(monkeypatch, capsys, option, value):
    """Without CUDA a bad value is argparse's usage error (exit 2), as with a GPU, before the no-GPU line."""
    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(SystemExit) as exit_info:
        cli.main(["bench", option, value])
    assert exit_info.value.code == 2
    assert f"vit-fast bench: error: argument {option}: " in capsys.readouterr().err


def test_info_refuses_the_triton_backend_on_cpu_outside_the_interpreter(monkeypatch, capsys):
    """The forward runs on CPU tensors: without TRITON_INTERPRET=1 a usage error says what to do, not a traceback."""
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    with pytest.raises(SystemExit) as exit_info:
        cli.main(["info", "--model", "vit_tiny_patch16_224", "--backend", "triton"])
    assert exit_info.value.code == 2 and "TRITON_INTERPRET=1" in capsys.readouterr().err
