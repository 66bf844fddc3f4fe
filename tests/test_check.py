"""`vit-fast check`: runs in a fresh process (re-executing itself under the Triton interpreter when there is
no CUDA), prints the table and passes; a broken kernel makes it report FAIL and return 1."""
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import vit_fast.kernels.attention.interface as A
import vit_fast.kernels.bias_gelu as G
from vit_fast._compat import monkeypatch_setting  # torch settings served by __getattr__
from vit_fast.tools import check

TINY = ["--model", "vit_tiny_patch16_224", "--batch", "1", "--depth", "1"]
ROW = re.compile(r"^(\S+(?: \S+)?)\s+([\dx]+)\s+(fp32|fp16|bf16)\s+(\S+)\s+(\S+)\s+(\S+)\s+(PASS|FAIL)$", re.M)


def test_cli_passes_in_a_fresh_process():
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}  # as a user's shell: check sets it
    result = subprocess.run([sys.executable, "-m", "vit_fast.tools.cli", "check", *TINY], capture_output=True,
                            text=True, timeout=240, env=env)
    assert result.returncode == 0, result.stdout + result.stderr
    out = result.stdout
    if not torch.cuda.is_available():
        assert "Triton interpreter on CPU, reduced size" in out
    rows = ROW.findall(out)
    ops = {name.split(" ")[0] for name, *_ in rows}
    assert ops - {"attention_short", "patch_embed_cublas_dw", "linear_act_tma"} == {
        "layer_norm", "add_layer_norm", "bias_gelu", "linear_act", "bias_dropout_add", "attention", "attention_linear",
        "attention_linear_stored_ds", "patch_embed", "model"}, out
    # 16-bit only: bf16 on CUDA, fp32 here
    assert ("attention_short" in ops) == ("patch_embed_cublas_dw" in ops) == torch.cuda.is_available(), out
    hopper = torch.cuda.is_available() and torch.cuda.get_device_capability()[0] >= 9
    assert ("linear_act_tma" in ops) == hopper, out
    assert all(r[-1] == "PASS" for r in rows) and "FAIL" not in out
    assert any(name == "model logits" for name, *_ in rows)
    assert any(name.startswith("model dblocks.*.") for name, *_ in rows)
    assert f"{len(rows)}/{len(rows)} passed" in out


def test_broken_kernel_is_reported(monkeypatch, capsys):
    """A 1% error in the attention kernel fails its rows and the model's (the model runs the kernel too);
    the untouched bias_gelu rows still pass."""
    attention = A._attention_with_lse  # behind attention and attention_linear (which the model calls)

    def off_by_one_percent(*args, **kw):
        out, lse = attention(*args, **kw)
        return out * 1.01, lse

    monkeypatch.setattr(A, "_attention_with_lse", off_by_one_percent)
    assert check.main([*TINY, "--ops", "attention,bias_gelu,model"]) == 1
    out = capsys.readouterr().out
    status = {name: result for name, *_, result in ROW.findall(out)}
    assert status["attention out"] == "FAIL" and status["model logits"] == "FAIL"
    assert status["bias_gelu out"] == status["bias_gelu dx"] == status["bias_gelu dbias"] == "PASS"
    assert "FAILED: attention out" in out


def test_nan_never_passes(monkeypatch, capsys):
    bias_gelu = G.bias_gelu

    def one_nan(x, bias, approximate="none"):
        out = bias_gelu(x, bias, approximate)
        return out.index_put((torch.tensor([0]),), torch.tensor(float("nan")))

    monkeypatch.setattr(G, "bias_gelu", one_nan)
    assert check.main([*TINY, "--ops", "bias_gelu"]) == 1
    status = {name: result for name, *_, result in ROW.findall(capsys.readouterr().out)}
    assert status["bias_gelu out"] == "FAIL"


def test_bad_arguments(capsys):
    assert check.main(["--model", "vit_nope", "--ops", "layer_norm"]) == 2
    assert "vit_nope" in capsys.readouterr().err


def test_table_header_says_the_bound_is_relative(capsys):
    """The bound column bounds the relative error ||out - ref|| / ||ref||: its header says so ("rel. bound"), the
    value sits under it, and the README's excerpt quotes the same columns."""
    check.print_table([check.Row("layer_norm dweight", (768,), torch.float32, 1.27e-6, 8.03e-8, 1e-6)])
    header, row = capsys.readouterr().out.splitlines()
    assert "rel err  rel. bound  result" in header
    assert header.index("rel. bound") + len("rel. bound") == row.index("1.0e-06") + len("1.0e-06")
    readme = (Path(__file__).resolve().parents[1] / "README.md").read_text()
    quoted = next(line for line in readme.splitlines() if line.startswith("op ") and "max abs err" in line)
    assert re.split(r"\s{2,}", quoted) == re.split(r"\s{2,}", header)


def test_check_leaves_the_tf32_flags_as_it_found_them(monkeypatch):
    """check turns TF32 off for its comparison only: a leaked flag changes the fp32 configs that later
    kernels (and `vit-fast report`) pick."""
    monkeypatch_setting(monkeypatch, torch.backends.cuda.matmul, "allow_tf32", True)
    monkeypatch_setting(monkeypatch, torch.backends.cudnn, "allow_tf32", True)
    assert check.main([*TINY, "--ops", "layer_norm"]) == 0
    assert torch.backends.cuda.matmul.allow_tf32 and torch.backends.cudnn.allow_tf32


def test_bf16_check_covers_the_short_attention_kernels(capsys):
    """In 16 bits the short-sequence attention family is checked too, forward and gradient."""
    assert check.main([*TINY, "--dtype", "bf16", "--ops", "attention"]) == 0
    rows = {name: result for name, *_, result in ROW.findall(capsys.readouterr().out)}
    assert rows["attention_short out"] == rows["attention_short dqkv"] == "PASS", rows


def test_bf16_check_covers_the_library_patch_embedding_dweight(capsys):
    """In 16 bits the patch embedding is checked twice: its dW GEMM by the kernel and on the library route."""
    assert check.main([*TINY, "--dtype", "bf16", "--ops", "patch_embed"]) == 0
    rows = {name: result for name, *_, result in ROW.findall(capsys.readouterr().out)}
    assert rows["patch_embed_cublas_dw dweight"] == rows["patch_embed dweight"] == "PASS", rows


def test_bf16_check_covers_the_tma_linear_act_kernels(capsys):
    """In 16 bits (on sm_90+ GPUs, or in the interpreter) linear_act is checked twice: on the autotuner's choice
    and on the persistent TMA kernels."""
    if torch.cuda.is_available() and torch.cuda.get_device_capability()[0] < 9:
        pytest.skip("TMA kernels need sm_90+")
    assert check.main([*TINY, "--dtype", "bf16", "--ops", "linear_act"]) == 0
    rows = {name: result for name, *_, result in ROW.findall(capsys.readouterr().out)}
    assert rows["linear_act_tma out"] == rows["linear_act_tma dx"] == rows["linear_act_tma dw1"] == "PASS", rows
