"""Bad inputs: every one raises one clear error of an exact type naming what was expected, or gives the right result.

Covers the kernels, the model's entry (both backends), ``optimize``, the checkpoint reader and the
`vit-fast train` command line (issue 23: every case it lists is here; the kill / resume cases are in
tests/test_train.py). Random shapes, dtypes and option values come from hypothesis; every case stops in
validation before any kernel launches, so each takes milliseconds.
"""
import os
import shutil

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import vit_fast
from vit_fast import CheckpointError, load_checkpoint, save_checkpoint
from vit_fast.interop.convert import CheckpointNotFoundError, read_state_dict
from vit_fast.kernels._utils import interpreter_active
from vit_fast.kernels.attention import attention
from vit_fast.kernels.layer_norm import layer_norm
from vit_fast.training import train as vt

FAST = settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
FLOATS = (torch.float32, torch.float16, torch.bfloat16)
NOT_FLOATS = (torch.int32, torch.int64, torch.uint8, torch.bool, torch.float64)
interpreter_or_gpu = pytest.mark.skipif(not (torch.cuda.is_available() or interpreter_active()),
                                        reason="the Triton path needs CUDA or the interpreter")


def tiny(backend="torch", **kw):
    torch.manual_seed(0)
    return vit_fast.create_model("vit_tiny_patch16_224", img_size=32, patch_size=8, depth=1, embed_dim=32,
                                 num_heads=2, num_classes=7, backend=backend, **kw)


def device_for(backend):
    """Where ``backend`` runs its own path: the Triton kernels on CUDA when there is a GPU, else the interpreter."""
    return "cuda" if backend == "triton" and torch.cuda.is_available() else "cpu"


# ------------------------------------------------------------------------------------------------ kernels
@FAST
@given(rows=st.integers(1, 5), n=st.integers(1, 96), wrong=st.integers(1, 96))
def test_layer_norm_weight_of_another_width_names_the_expected_shape(rows, n, wrong):
    if wrong == n:
        wrong += 1
    x, w, b = torch.randn(rows, n), torch.ones(wrong), torch.zeros(n)
    with pytest.raises(ValueError, match=rf"layer_norm: .*weight of shape \({n},\)"):
        layer_norm(x, w, b)


@FAST
@given(dtype=st.sampled_from(NOT_FLOATS), n=st.integers(1, 64))
def test_layer_norm_non_float_input_names_the_dtypes(dtype, n):
    x = torch.zeros(2, n, dtype=dtype)
    with pytest.raises(ValueError, match=rf"layer_norm: expected x with dtype in \(.*\), got {dtype}"):
        layer_norm(x, torch.ones(n), torch.zeros(n))


@pytest.mark.parametrize("override, message", [
    (dict(num_heads=0), "num_heads must be an integer >= 1"), (dict(num_heads=2.0), "num_heads must be an integer"),
    (dict(patch_size=0), "patch_size must be an integer >= 1"), (dict(embed_dim=0), "embed_dim must be an integer"),
    (dict(img_size=0), "img_size must be an integer >= 1"), (dict(depth=1.5), "depth must be an integer >= 0"),
    (dict(mlp_ratio=0), "mlp_ratio must be a finite number > 0"), (dict(norm_eps=0.0), "norm_eps must be a finite"),
    (dict(norm_eps=-1), "norm_eps must be a finite number > 0")])
def test_config_sizes_and_rates_are_checked_at_build(override, message):
    """Each was a ZeroDivisionError, a torch error, or a model that built and failed at its first forward."""
    with pytest.raises(ValueError, match=f"ViTConfig: {message}"):
        vit_fast.create_model("vit_tiny_patch16_224", **{"img_size": 32, **override})


def test_row_kernels_refuse_zero_width_naming_it():
    """A zero-width input (N = 0) failed inside torch's reshape; each row kernel names N >= 1."""
    from vit_fast.kernels.bias_gelu import bias_gelu
    from vit_fast.kernels.swiglu import swiglu, swiglu_packed

    x = torch.randn(2, 0)
    for op, call in (("layer_norm", lambda: layer_norm(x, torch.ones(0), torch.zeros(0))),
                     ("bias_gelu", lambda: bias_gelu(x, torch.zeros(0))), ("swiglu", lambda: swiglu(x, x)),
                     ("swiglu_packed", lambda: swiglu_packed(x))):
        with pytest.raises(ValueError, match=rf"{op}: expected .* >= 1, got shape \(2, 0\)"):
            call()


@FAST
@given(num_heads=st.sampled_from([0, -1, 2.5, True, "2", None]))
def test_attention_bad_num_heads(num_heads):
    with pytest.raises(ValueError, match="attention: expected num_heads to be a positive int"):
        attention(torch.randn(1, 4, 24), num_heads)


@FAST
@given(heads=st.integers(1, 4), width=st.integers(1, 100))
def test_attention_packed_width_not_a_multiple_of_three_heads(heads, width):
    if width % (3 * heads) == 0:
        width += 1
    message = rf"attention: expected qkv last dim divisible by 3 \* num_heads = {3 * heads}"
    with pytest.raises(ValueError, match=message):
        attention(torch.randn(1, 4, width), heads)


# ------------------------------------------------------------------------------------------------ model entry
def backends():
    return ["torch", pytest.param("triton", marks=interpreter_or_gpu)]


@pytest.mark.parametrize("backend", backends())
def test_batch_zero_gives_empty_logits_and_gradients_on_both_backends(backend):
    device = device_for(backend)
    model = tiny(backend).to(device)
    x = torch.randn(0, 3, 32, 32, device=device, requires_grad=True)
    logits = model(x)
    assert logits.shape == (0, 7)
    logits.sum().backward()
    assert x.grad.shape == (0, 3, 32, 32)
    assert all(p.grad is None or torch.count_nonzero(p.grad) == 0 for p in model.parameters())
    assert model.forward_features(torch.randn(0, 3, 32, 32, device=device)).shape == (0, 17, 32)


@pytest.mark.parametrize("backend", backends())
@pytest.mark.parametrize("bad", [[1.0, 2.0], None, 3, "image", (torch.randn(1, 3, 32, 32),)],
                         ids=["list", "None", "int", "str", "tuple"])
def test_non_tensor_input_is_one_clear_error(backend, bad):
    for entry in ("__call__", "forward_features"):
        message = rf"expected a torch.Tensor image batch \(B, 3, H, W\), got {type(bad).__name__}"
        with pytest.raises(ValueError, match=message):
            getattr(tiny(backend), entry)(bad)


def test_forward_intermediates_checks_the_same_way():
    with pytest.raises(ValueError, match="expected a torch.Tensor image batch .* got list"):
        tiny().forward_intermediates([1.0])
    with pytest.raises(ValueError, match="expected an image batch of the model's dtype torch.float32"):
        tiny().forward_intermediates(torch.randn(1, 3, 32, 32, dtype=torch.float64))


def test_numpy_array_input_names_the_type():
    np = pytest.importorskip("numpy")
    with pytest.raises(ValueError, match="expected a torch.Tensor image batch .* got ndarray"):
        tiny()(np.zeros((1, 3, 32, 32), dtype=np.float32))


DTYPE_PAIRS = [(x, m) for x in (*FLOATS, torch.float64) for m in FLOATS if x != m]


@pytest.mark.parametrize("x_dtype, model_dtype", DTYPE_PAIRS, ids=[f"{x}->{m}" for x, m in DTYPE_PAIRS])
def test_dtype_mismatch_outside_autocast_is_the_same_error_on_both_backends(x_dtype, model_dtype):
    messages = []
    for backend in ("torch", "triton"):
        device = device_for(backend)
        model = tiny(backend).to(device, model_dtype)
        with pytest.raises(ValueError) as info:
            model(torch.randn(2, 3, 32, 32, dtype=x_dtype, device=device))
        messages.append(str(info.value))
    assert messages[0] == messages[1]
    assert f"expected an image batch of the model's dtype {model_dtype}" in messages[0] and str(x_dtype) in messages[0]


@pytest.mark.parametrize("backend", backends())
def test_under_autocast_any_image_dtype_of_the_three_is_accepted(backend):
    device = device_for(backend)
    model = tiny(backend).to(device)
    with torch.autocast(device, dtype=torch.bfloat16):
        for dtype in FLOATS:
            assert model(torch.randn(1, 3, 32, 32, dtype=dtype, device=device)).shape == (1, 7)
        with pytest.raises(ValueError, match="expected a float32/float16/bfloat16 image batch under autocast, "
                                             "got torch.float64"):
            model(torch.randn(1, 3, 32, 32, dtype=torch.float64, device=device))


@FAST
@given(shape=st.lists(st.integers(0, 4), min_size=0, max_size=6).filter(lambda s: len(s) != 4))
def test_wrong_rank_names_the_expected_layout(shape):
    with pytest.raises(ValueError, match=rf"expected a 4-D image batch \(B, C, H, W\) with C=3, got a {len(shape)}-D"):
        tiny()(torch.zeros(shape))


@FAST
@given(dtype=st.sampled_from((torch.int64, torch.uint8, torch.bool, torch.int16)))
def test_integer_images_name_the_float_dtypes(dtype):
    with pytest.raises(ValueError, match=rf"expected a floating-point image batch .*got {dtype}"):
        tiny()(torch.zeros(1, 3, 32, 32, dtype=dtype))


def test_meta_input_into_a_cpu_model_names_both_devices():
    with pytest.raises(ValueError, match=r"expected the image batch on the model's device \(cpu\), got a "
                                         r"tensor on meta"):
        tiny()(torch.empty(1, 3, 32, 32, device="meta"))


# ------------------------------------------------------------------------------------------------ optimize
def test_optimize_of_a_meta_device_source_is_refused_clearly():
    timm = pytest.importorskip("timm")
    with torch.device("meta"):
        source = timm.create_model("vit_tiny_patch16_224", img_size=32, patch_size=8, depth=1)
    with pytest.raises(ValueError, match="optimize: the timm model is on the meta device .*materialise it first"):
        vit_fast.optimize(source)


def test_optimize_of_a_meta_device_vit_fast_model_stays_on_meta():
    with torch.device("meta"):
        model = tiny()
    assert vit_fast.optimize(model, backend="torch") is model and model.pos_embed.is_meta


def test_optimize_of_a_non_vit_names_the_accepted_models():
    with pytest.raises(ValueError, match="optimize: expected a timm VisionTransformer.*got "
                                         "torch.nn.modules.linear.Linear"):
        vit_fast.optimize(torch.nn.Linear(2, 2))


# ------------------------------------------------------------------------------------------------ checkpoints
@pytest.fixture(scope="module")
def files(tmp_path_factory):
    root = tmp_path_factory.mktemp("ckpt")
    model = tiny()
    save_checkpoint(model, root / "good.safetensors")
    save_checkpoint(model, root / "good.pt")
    return root, model


def _truncate(src, dst, keep):
    dst.write_bytes(src.read_bytes()[:keep])
    return dst


DAMAGED = {   # name -> (how to make it from the good files, what the message must say)
    "half.safetensors": (lambda r: _truncate(r / "good.safetensors", r / "half.safetensors",
                                             (r / "good.safetensors").stat().st_size // 2), "damaged safetensors"),
    "header.safetensors": (lambda r: _truncate(r / "good.safetensors", r / "header.safetensors", 20),
                           "truncated safetensors file"),
    "seven.safetensors": (lambda r: _truncate(r / "good.safetensors", r / "seven.safetensors", 7), "neither"),
    "half.pt": (lambda r: _truncate(r / "good.pt", r / "half.pt", (r / "good.pt").stat().st_size // 2),
                "truncated or damaged torch.save file"),
    "empty.pt": (lambda r: _truncate(r / "good.pt", r / "empty.pt", 0), r"is empty \(0 bytes\)"),
    "dir.safetensors": (lambda r: (r / "dir.safetensors").mkdir() or r / "dir.safetensors", "is a directory"),
    "text.pt": (lambda r: (r / "text.pt").write_text("hello") and r / "text.pt", "neither a safetensors file nor"),
}


@pytest.mark.parametrize("name", DAMAGED)
def test_damaged_checkpoint_is_a_checkpoint_error_naming_the_file(files, name):
    root, model = files
    make, what = DAMAGED[name]
    path = make(root)
    for read in (lambda: load_checkpoint(model, path), lambda: read_state_dict(path)):
        with pytest.raises(CheckpointError, match=what) as info:
            read()
        assert str(path) in str(info.value)


def test_missing_checkpoint_is_both_checkpoint_and_file_not_found_error(files):
    root, model = files
    with pytest.raises(CheckpointNotFoundError, match="nope.pt': no such file") as info:
        load_checkpoint(model, root / "nope.pt")
    assert isinstance(info.value, FileNotFoundError) and isinstance(info.value, CheckpointError)


def test_meta_tensors_tied_weights_and_metadata_in_checkpoints(tmp_path):
    """Saving and loading what torch or safetensors would fail on deep inside, or do silently: tensors sharing
    memory (a buffer viewing a parameter) are saved (safetensors refused them) and load back; metadata other than
    str to str, or with a torch.save file (it was dropped), is refused; a model on the meta device is refused
    when saved (NotImplementedError) and when loaded into (torch copied into nothing, with warnings), and so is a
    file of meta tensors (a RuntimeError from the copy)."""
    model = tiny()
    model.register_buffer("head_rows", model.head.weight[:2])  # shares the head's memory
    save_checkpoint(model, tmp_path / "tied.safetensors")
    other = tiny()
    other.register_buffer("head_rows", torch.zeros(2, 32))
    load_checkpoint(other, tmp_path / "tied.safetensors")
    assert torch.equal(other.head.weight, model.head.weight) and torch.equal(other.head_rows, model.head_rows)
    with pytest.raises(ValueError, match="metadata is written to .safetensors files only"):
        save_checkpoint(model, tmp_path / "m.pt", metadata={"epoch": "3"})
    with pytest.raises(ValueError, match="expected metadata as a dict of str to str"):
        save_checkpoint(model, tmp_path / "m.safetensors", metadata={"epoch": 3})
    del model.head_rows
    save_checkpoint(model, tmp_path / "w.safetensors")
    with torch.device("meta"):
        on_meta = tiny()
    with pytest.raises(ValueError, match="on the meta device .* materialise it first"):
        save_checkpoint(on_meta, tmp_path / "meta.safetensors")
    with pytest.raises(CheckpointError, match=r"on the meta device .* model.to_empty\(device=...\) before loading"):
        load_checkpoint(on_meta, tmp_path / "w.safetensors")
    torch.save({k: torch.empty_like(v, device="meta") for k, v in model.state_dict().items()}, tmp_path / "meta.pt")
    with pytest.raises(CheckpointError, match="holds tensors without data"):
        load_checkpoint(tiny(), tmp_path / "meta.pt")
    from vit_fast.training import checkpoint as ckpt  # vit-fast train's writer, the same rule

    weight = torch.randn(4, 3)
    written = ckpt.write_checkpoint(tmp_path / "run", 1, {"w": weight, "w_rows": weight[:2]}, {})
    assert torch.equal(ckpt.read_weights(written)["w_rows"], weight[:2])


@pytest.mark.parametrize("suffix", [".safetensors", ".pt"])
def test_saving_into_a_missing_folder_names_it(files, suffix):
    root, model = files
    with pytest.raises(FileNotFoundError, match="its folder '.*no_such_dir' does not exist"):
        save_checkpoint(model, root / "no_such_dir" / f"w{suffix}")
    assert not (root / "no_such_dir").exists()


def test_swapped_suffixes_load_by_content(files):
    root, model = files
    shutil.copy(root / "good.pt", root / "torch_file.safetensors")
    shutil.copy(root / "good.safetensors", root / "safetensors_file.pt")
    for name in ("torch_file.safetensors", "safetensors_file.pt"):
        other = tiny()
        with torch.no_grad():
            other.head.weight.zero_()
        load_checkpoint(other, root / name)
        assert torch.equal(other.head.weight, model.head.weight)


def test_safetensors_header_length_ending_in_0x80_is_read_as_safetensors(files, tmp_path):
    """A safetensors file starts with its header length (u64, little-endian, a multiple of 8): one file in 32 starts
    with byte 0x80, a pickle's first byte; it is read as safetensors, by load_checkpoint and by vit-fast train's
    checkpoint writer, which reads back what it wrote."""
    from safetensors.torch import save_file

    from vit_fast.interop.convert import sniff_checkpoint_format
    from vit_fast.training import checkpoint as ckpt

    model = files[1]
    for pad in range(0, 256, 8):   # the metadata's length moves the header length in steps of 8
        path = tmp_path / "w.safetensors"
        save_file(model.state_dict(), str(path), metadata={"pad": "x" * pad})
        if path.read_bytes()[0] == 0x80:
            break
    assert path.read_bytes()[0] == 0x80
    assert sniff_checkpoint_format(path) == "safetensors"
    other = tiny()
    with torch.no_grad():
        other.head.weight.zero_()
    load_checkpoint(other, path)
    assert torch.equal(other.head.weight, model.head.weight)
    for n in range(1, 40):   # some state dict gives the training checkpoint's weights such a header too
        weights = {f"w{i}": torch.zeros(2) for i in range(n)}
        ckpt.write_checkpoint(tmp_path / "run" / str(n), 1, weights, {"step_marker": torch.ones(1)})
        written = next((tmp_path / "run" / str(n)).glob("step_*")) / ckpt.WEIGHTS
        if written.read_bytes()[0] == 0x80:
            ckpt.verify_checkpoint(written.parent)
            assert torch.equal(ckpt.read_weights(written.parent)["w0"], torch.zeros(2))
            break
    assert written.read_bytes()[0] == 0x80


class Evil:
    def __reduce__(self):
        return (os.system, ("echo pwned > /dev/null",))


@pytest.fixture
def evil_file(tmp_path):
    torch.save({"head.weight": Evil()}, tmp_path / "evil.pt")
    return tmp_path / "evil.pt"


def test_pickled_code_is_refused_saying_only_tensors_are_loaded(files, evil_file):
    with pytest.raises(CheckpointError, match="holds pickled code, not only tensors; only tensors are loaded") as info:
        load_checkpoint(files[1], evil_file)
    assert str(evil_file) in str(info.value) and "posix.system" in str(info.value)


def test_a_dict_that_is_not_a_state_dict_names_its_entries(tmp_path):
    """A file holding only another wrapper (timm's 'state_dict_ema') or extras names them; a non-string key is a
    CheckpointError (it was an AttributeError in the key-name mapping)."""
    sd = tiny().state_dict()
    torch.save({"state_dict_ema": sd, "epoch": 3}, tmp_path / "ema.pt")
    with pytest.raises(CheckpointError, match=r"ema.pt' does not hold a state dict of tensors \(got dict with "
                                              r"entries that are not tensors: 'state_dict_ema' \(OrderedDict\), "
                                              r"'epoch' \(int\)"):
        load_checkpoint(tiny(), tmp_path / "ema.pt")
    torch.save({0: torch.ones(1), **sd}, tmp_path / "int_key.pt")
    with pytest.raises(CheckpointError, match=r"keys that are not strings \(\['0'\]\)"):
        load_checkpoint(tiny(), tmp_path / "int_key.pt")


def test_not_a_dict_of_tensors(tmp_path):
    torch.save([torch.ones(1)], tmp_path / "list.pt")
    with pytest.raises(CheckpointError, match=r"list.pt' does not hold a state dict of tensors \(got list\)"):
        read_state_dict(tmp_path / "list.pt")


@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(fraction=st.floats(0.0, 0.999), which=st.sampled_from(["good.safetensors", "good.pt"]))
def test_any_truncation_is_a_checkpoint_error(files, tmp_path_factory, fraction, which):
    root, _ = files
    size = (root / which).stat().st_size
    path = _truncate(root / which, tmp_path_factory.mktemp("cut") / f"cut_{which}", int(size * fraction))
    with pytest.raises(CheckpointError) as info:
        read_state_dict(path)
    assert str(path) in str(info.value)


# ------------------------------------------------------------------------------------------------ CLI
BAD_OPTIONS = [
    (["--warmup-epochs", "-1"], "--warmup-epochs: expected a number >= 0, got -1"),
    (["--epochs", "0"], "--epochs: expected an integer >= 1, got 0"),
    (["--epochs", "-1"], "--epochs: expected an integer >= 1, got -1"),
    (["--ckpt-every", "0"], "--ckpt-every: expected an integer >= 1"),
    (["--log-every", "0"], "--log-every: expected an integer >= 1"),
    (["--eval-every", "0"], "--eval-every: expected an integer >= 1"),
    (["--accum-steps", "0"], "--accum-steps: expected an integer >= 1"),
    (["--lr", "0"], "--lr: expected a number > 0, got 0"),
    (["--lr", "nan"], "--lr: expected a number > 0, got nan"),
    (["--drop-path-rate", "1.5"], "--drop-path-rate: expected a number >= 0 and < 1, got 1.5"),
    (["--label-smoothing", "1"], "--label-smoothing: expected a number >= 0 and < 1"),
    (["--batch-size", "0"], "--batch-size: expected an integer >= 1"),
    (["--epochs", "two"], "--epochs: expected an integer, got 'two'"),
    (["--device", "gpu0"], "--device: expected a device such as cpu, cuda or cuda:1, got 'gpu0'"),
    (["--min-lr", "0.1", "--lr", "0.01"], r"--min-lr: expected a value <= --lr \(0.01\), got 0.1"),
    (["--warmup-epochs", "30", "--epochs", "2"], r"--warmup-epochs: expected a value <= --epochs \(2\), got 30.0"),
    (["--bf16-residual"], r"--bf16-residual: only with --amp bf16 or fp16"),
    (["--data-dir", "/tmp"], r"--data-dir: only with --dataset imagefolder \(got --dataset digits\)"),
]


@pytest.mark.parametrize("argv, message", BAD_OPTIONS, ids=[" ".join(a) for a, _ in BAD_OPTIONS])
def test_bad_option_is_argparses_error(capsys, argv, message):
    with pytest.raises(SystemExit) as info:
        vt.resolve_args(["--dataset", "digits", *argv])
    assert info.value.code == 2
    assert "vit-fast train: error: argument" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        vt.resolve_args(["--dataset", "digits", *argv])
    assert len(__import__("re").findall(message, capsys.readouterr().err)) == 1


@settings(max_examples=40, deadline=None)
@given(option=st.sampled_from(["--epochs", "--ckpt-every", "--log-every", "--eval-every", "--accum-steps",
                               "--batch-size", "--depth", "--threads", "--stop-at-step"]),
       value=st.integers(-10**6, 0))
def test_non_positive_counts_are_refused(option, value):
    with pytest.raises(SystemExit) as info:
        vt.resolve_args([option, str(value)])
    assert info.value.code == 2


@settings(max_examples=40, deadline=None)
@given(option=st.sampled_from(["--lr", "--min-lr", "--warmup-epochs", "--weight-decay", "--clip-grad",
                               "--drop-path-rate", "--label-smoothing"]),
       value=st.floats(max_value=-1e-9) | st.sampled_from([float("nan"), float("-inf")]))
def test_negative_or_non_finite_rates_are_refused(option, value):
    with pytest.raises(SystemExit) as info:
        vt.resolve_args([option, repr(value)])
    assert info.value.code == 2


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without a GPU")
@pytest.mark.parametrize("device", ["cuda", "cuda:1"])
def test_device_cuda_without_gpu_says_so(capsys, device):
    with pytest.raises(SystemExit):
        vt.resolve_args(["--device", device])
    assert f"argument --device: '{device}': no cuda device is available on this machine" in capsys.readouterr().err


TINY = ["--dataset", "digits", "--img-size", "16", "--patch-size", "4", "--depth", "1", "--embed-dim", "16",
        "--num-heads", "2", "--batch-size", "32", "--epochs", "1", "--backend", "torch", "--no-progress", "--no-plot",
        "--threads", "1"]


def test_fewer_classes_than_the_data_is_refused_before_the_first_step(tmp_path, capsys):
    with pytest.raises(ValueError, match=r"--num-classes 5 is fewer than the digits data's 10 classes .*expected "
                                         r"--num-classes >= 10"):
        vt.main([*TINY, "--num-classes", "5", "--output-dir", str(tmp_path)])
    assert not (tmp_path / "metrics.jsonl").exists()   # refused before the run started
    assert vt.cli_main([*TINY, "--num-classes", "5", "--output-dir", str(tmp_path)]) == 2
    assert "vit-fast train: error: --num-classes 5" in capsys.readouterr().err


def test_init_from_pickled_code_says_only_tensors_are_loaded(tmp_path, capsys, evil_file):
    argv = [*TINY, "--init-from", f"file:{evil_file}", "--output-dir", str(tmp_path)]
    with pytest.raises(CheckpointError, match="holds pickled code, not only tensors; only tensors are loaded"):
        vt.main(argv)
    assert vt.cli_main(argv) == 2
    err = capsys.readouterr().err
    assert str(evil_file) in err and "Traceback" not in err


def test_init_from_a_truncated_file_names_it(tmp_path, files):
    cut = _truncate(files[0] / "good.safetensors", tmp_path / "cut.safetensors", 100)
    with pytest.raises(CheckpointError, match="cut.safetensors"):
        vt.main([*TINY, "--init-from", f"file:{cut}", "--output-dir", str(tmp_path / "run")])


def test_init_from_a_directory_or_missing_file(tmp_path):
    with pytest.raises(CheckpointError, match="is a directory"):
        vt.main([*TINY, "--init-from", f"file:{tmp_path}", "--output-dir", str(tmp_path / "run")])
    with pytest.raises(FileNotFoundError, match="no such file"):
        vt.main([*TINY, "--init-from", f"file:{tmp_path / 'none.pt'}", "--output-dir", str(tmp_path / "run")])


# ------------------------------------------------------------------------------------------------ training checkpoints
# (issue 23 cases 2 and 9 with real training runs, kill -9 included: tests/test_train.py)
@settings(max_examples=15, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(which=st.sampled_from(["model.safetensors", "state.pt"]), fraction=st.floats(0.0, 0.999))
def test_damaged_newest_training_checkpoint_falls_back_naming_it(tmp_path_factory, caplog, which, fraction):
    import logging

    from vit_fast.training import checkpoint as ckpt

    root = tmp_path_factory.mktemp("run") / "checkpoints"
    for step in (1, 2):
        ckpt.write_checkpoint(root, step, {"w": torch.full((64,), float(step))}, {"step_marker": torch.ones(8)})
    path = root / "step_00000002" / which
    path.write_bytes(path.read_bytes()[:int(path.stat().st_size * fraction)])
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="vit_fast.training.checkpoint"):
        found = ckpt.resumable_checkpoint(root)
    assert found.name == "step_00000001" and str(path) in caplog.text
    assert (root / "step_00000002.damaged").is_dir() and (root / ckpt.LATEST).read_text().strip() == found.name
    assert torch.equal(ckpt.read_weights(found)["w"], torch.ones(64))


@interpreter_or_gpu
def test_join_ops_refuse_a_drop_path_scale_that_does_not_divide_the_rows():
    """The join custom ops index the drop-path scale per sample (row // rows per sample): called directly with a
    scale whose length does not divide the rows, they refuse it instead of reading past its end."""
    device = device_for("triton")
    x = torch.randn(6, 32, device=device)
    w, b = torch.ones(32, device=device), torch.zeros(32, device=device)
    for scale in (torch.ones(4, device=device), torch.ones(0, device=device)):
        with pytest.raises(ValueError, match="one entry per sample"):
            torch.ops.vit_fast.add_layer_norm_fwd(x, x, w, b, None, None, scale, 1e-6, 0.0, None)
        with pytest.raises(ValueError, match="one entry per sample"):
            torch.ops.vit_fast.bias_dropout_add_fwd(x, None, x, None, scale, 0.0, None)
    stats = torch.zeros(6, device=device)
    with pytest.raises(ValueError, match="one entry per sample"):
        torch.ops.vit_fast.add_layer_norm_bwd(x, None, x, x, w, b, None, None, torch.ones(4, device=device), stats,
                                              stats, 0.0, None, True)


def test_from_timm_names_what_it_expected_for_something_that_is_no_timm_state_dict():
    from vit_fast.interop.convert import from_timm

    for bad in ("hello", {"a": 1}):
        with pytest.raises(ValueError, match="from_timm: expected a timm VisionTransformer or its state dict"):
            from_timm(bad)
    for bad in ({}, {"head.weight": torch.zeros(2, 3)}):
        with pytest.raises(CheckpointError, match="no 'patch_embed.proj.weight'"):
            from_timm(bad)


@pytest.mark.parametrize("argv, message", [
    (["traffic", "--model", "vit_bogus"], "argument --model: unknown model 'vit_bogus'; available:"),
    (["traffic", "--batch", "0"], "argument --batch: expected an integer >= 1, got 0"),
    (["host", "--model", "vit_bogus"], "argument --model: unknown model 'vit_bogus'"),
    (["report", "--presets", "vit_bogus"], "argument --presets: unknown model 'vit_bogus'")])
def test_cli_commands_refuse_a_bad_preset_or_batch_as_argparse_does(capsys, argv, message):
    """Each was a traceback (an unknown preset deep in the command, a ZeroDivisionError for batch 0)."""
    from vit_fast.tools import cli

    with pytest.raises(SystemExit) as info:
        cli.main(argv)
    assert info.value.code == 2 and message in capsys.readouterr().err


def test_a_config_error_shows_the_fields_it_is_about_not_the_whole_config():
    with pytest.raises(ValueError) as info:
        vit_fast.create_model("vit_base_patch16_224", img_size=100)
    assert str(info.value) == ("ViTConfig: img_size must be divisible by patch_size; got img_size=(100, 100), "
                               "patch_size=(16, 16)")
