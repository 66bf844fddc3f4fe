"""Autotuning runtime (vit_fast/kernels/_tuning.py) and the per-fusion choice (vit_fast/tuning.py), on CPU.

Nothing is timed for real: an injected timer returns chosen times per label (and counts its calls), and
the tests allow timing on 'cpu' where they need the selection logic to run. The cache lives in tmp_path.
"""
from __future__ import annotations

import copy
import json
import multiprocessing
import os
import warnings

import pytest
import torch

import vit_fast
from vit_fast import tuning
from vit_fast.kernels import _tuning

from .numerics import assert_close, bound

CPU = torch.device("cpu")
TINY = dict(img_size=32, patch_size=8, embed_dim=64, depth=2, num_heads=4, num_classes=10)
CANDIDATES = [("static", 64), ("wide", 128), ("narrow", 32)]


class FakeTimer:
    """Times by label: ``times[name]`` milliseconds where ``name`` is in the label (else 1.0); counts calls."""

    def __init__(self, **times: float):
        self.times, self.labels = times, []

    def __call__(self, fn, label: str) -> float:
        self.labels.append(label)
        return next((t for name, t in self.times.items() if name in label), 1.0)


class NoTimer:
    def __call__(self, fn, label):
        raise AssertionError(f"nothing should be timed here, got {label}")


def launches():
    calls = []

    def launch(cfg):
        calls.append(cfg)
    return launch, calls


@pytest.fixture
def cpu_tuning(tmp_path, monkeypatch):
    """Timing allowed on CPU with a fresh state and the cache in tmp_path; the switch follows a clean env."""
    monkeypatch.delenv(_tuning.ENV_SWITCH, raising=False)
    _tuning._warned.clear()

    def session(timer, **kw):
        return _tuning.overridden(**{"timer": timer, "device_types": ("cpu", "cuda"), "cache_dir": tmp_path, **kw})
    return session


# ------------------------------------------------------------------------------------------ selection
def test_the_fastest_candidate_is_chosen_logged_and_cached(cpu_tuning, tmp_path):
    timer = FakeTimer(static=3.0, wide=2.0, narrow=1.5)
    launch, _ = launches()
    with cpu_tuning(timer):
        got = _tuning.choose("op_a", (256, 768, "bf16", 90), CANDIDATES, launch, CPU, module=__name__)
        again = _tuning.choose("op_a", (256, 768, "bf16", 90), CANDIDATES, launch, CPU, module=__name__)
        records = _tuning.records()
    assert got == again == ("narrow", 32)
    assert len(timer.labels) == 3  # each candidate once; the second call is an in-process hit
    assert [r.choice for r in records] == [2] and records[0].speedup == pytest.approx(2.0)
    (path,) = tmp_path.glob("autotune-*.json")
    entry = json.loads(path.read_text())["entries"]["op_a|(256, 768, 'bf16', 90)"]
    assert entry["choice"] == repr(("narrow", 32)) and entry["times_ms"] == [3.0, 2.0, 1.5]


def test_ties_keep_the_static_first_candidate(cpu_tuning):
    launch, _ = launches()
    with cpu_tuning(FakeTimer()):
        assert _tuning.choose("op_tie", 1, CANDIDATES, launch, CPU, module=__name__) == CANDIDATES[0]


def test_a_candidate_that_cannot_run_here_is_skipped_and_other_errors_propagate(cpu_tuning):
    from triton.runtime.errors import OutOfResources

    class Failing(FakeTimer):
        def __call__(self, fn, label):
            super().__call__(fn, label)
            if "narrow" in label:
                raise OutOfResources(300000, 232448, "shared memory")
            if "wide" in label and self.bug:
                raise ZeroDivisionError("a bug in a launcher")
            return 2.0 if "static" in label else 1.0

    launch, _ = launches()
    timer = Failing()
    timer.bug = False
    with cpu_tuning(timer):
        assert _tuning.choose("op_oor", 1, CANDIDATES, launch, CPU, module=__name__) == CANDIDATES[1]
        assert _tuning.records()[0].times_ms[2] == float("inf")
    timer.bug = True
    with cpu_tuning(timer), pytest.raises(ZeroDivisionError):
        _tuning.choose("op_oor", 2, CANDIDATES, launch, CPU, module=__name__)


def test_a_candidate_out_of_device_memory_is_skipped(cpu_tuning):
    """A candidate that allocates a workspace (the stored-dS attention backward) and finds no device memory for it
    is timed as infinitely slow, as one that cannot compile: the others still run."""
    class OutOfMemory(FakeTimer):
        def __call__(self, fn, label):
            super().__call__(fn, label)
            if "narrow" in label:
                raise torch.cuda.OutOfMemoryError("CUDA out of memory. Tried to allocate 252.00 MiB")
            return 2.0 if "static" in label else 1.0

    launch, _ = launches()
    with cpu_tuning(OutOfMemory()):
        assert _tuning.choose("op_oom", 1, CANDIDATES, launch, CPU, module=__name__) == CANDIDATES[1]
        assert _tuning.records()[0].times_ms[2] == float("inf")


def test_cache_hit_in_a_new_process_state_and_miss_for_another_key(cpu_tuning):
    launch, _ = launches()
    with cpu_tuning(FakeTimer(wide=0.5)):
        assert _tuning.choose("op_b", "k1", CANDIDATES, launch, CPU, module=__name__) == CANDIDATES[1]
    with cpu_tuning(NoTimer()):  # fresh in-process state: the answer comes from the file
        assert _tuning.choose("op_b", "k1", CANDIDATES, launch, CPU, module=__name__) == CANDIDATES[1]
        assert _tuning.records() == []
    timer = FakeTimer(narrow=0.5)
    with cpu_tuning(timer):  # another shape bucket: a miss, timed
        assert _tuning.choose("op_b", "k2", CANDIDATES, launch, CPU, module=__name__) == CANDIDATES[2]
    assert len(timer.labels) == 3


def test_a_cached_choice_no_longer_among_the_candidates_is_a_miss(cpu_tuning):
    launch, _ = launches()
    with cpu_tuning(FakeTimer(wide=0.5)):
        _tuning.choose("op_c", 1, CANDIDATES, launch, CPU, module=__name__)
    timer = FakeTimer(other=0.1)
    with cpu_tuning(timer):
        assert _tuning.choose("op_c", 1, [CANDIDATES[0], ("other", 1)], launch, CPU, module=__name__) == ("other", 1)
    assert len(timer.labels) == 2


def test_a_source_change_invalidates_the_entry(cpu_tuning, monkeypatch):
    launch, _ = launches()
    with cpu_tuning(FakeTimer(wide=0.5)):
        _tuning.choose("op_d", 1, CANDIDATES, launch, CPU, module=__name__)
    monkeypatch.setattr(_tuning, "source_hash", lambda module: "edited-kernel-source")
    timer = FakeTimer(narrow=0.5)
    with cpu_tuning(timer):
        assert _tuning.choose("op_d", 1, CANDIDATES, launch, CPU, module=__name__) == CANDIDATES[2]
    assert len(timer.labels) == 3


@pytest.mark.parametrize("field", ["torch", "triton", "vit_fast", "driver", "gpu"])
def test_a_version_or_gpu_change_invalidates_the_cache(cpu_tuning, monkeypatch, field):
    launch, _ = launches()
    with cpu_tuning(FakeTimer(wide=0.5)):
        _tuning.choose("op_e", 1, CANDIDATES, launch, CPU, module=__name__)
    real = _tuning.environment
    monkeypatch.setattr(_tuning, "environment", lambda device=None: {**real(device), field: "another"})
    timer = FakeTimer(narrow=0.5)
    with cpu_tuning(timer):
        assert _tuning.choose("op_e", 1, CANDIDATES, launch, CPU, module=__name__) == CANDIDATES[2]
    assert len(timer.labels) == 3


def test_a_stale_file_of_another_environment_is_ignored_with_one_warning(cpu_tuning, tmp_path):
    cache = _tuning.TuningCache(_tuning.environment(CPU), tmp_path)
    cache.path.write_text(json.dumps({"format": 1, "env": {"torch": "0.0"}, "entries": {}}))
    launch, _ = launches()
    with cpu_tuning(FakeTimer(wide=0.5)), pytest.warns(RuntimeWarning, match="another environment") as caught:
        assert _tuning.choose("op_f", 1, CANDIDATES, launch, CPU, module=__name__) == CANDIDATES[1]
        assert _tuning.choose("op_f", 2, CANDIDATES, launch, CPU, module=__name__) == CANDIDATES[1]
    assert len([w for w in caught if "vit_fast autotune cache" in str(w.message)]) == 1
    assert json.loads(cache.path.read_text())["env"] == cache.env  # rewritten for this environment


@pytest.mark.parametrize("content", ["{not json", '{"format": 1, "env": {}, "entries": [1, 2]}', "[]", ""])
def test_a_corrupt_file_warns_once_never_crashes_and_is_rewritten(cpu_tuning, tmp_path, content):
    cache = _tuning.TuningCache(_tuning.environment(CPU), tmp_path)
    cache.path.write_text(content)
    launch, _ = launches()
    with cpu_tuning(FakeTimer(narrow=0.5)), warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for key in range(3):
            assert _tuning.choose("op_g", key, CANDIDATES, launch, CPU, module=__name__) == CANDIDATES[2]
    assert len([w for w in caught if "vit_fast autotune cache" in str(w.message)]) == 1
    assert len(json.loads(cache.path.read_text())["entries"]) == 3


def _write_entries(folder: str, env: dict, worker: int, count: int) -> None:
    cache = _tuning.TuningCache(env, folder)
    for i in range(count):
        cache.put({f"op|w{worker}-{i}": {"source": "s", "choice": "c", "times_ms": [float(i)]}})


def test_concurrent_writers_from_several_processes_lose_nothing(tmp_path):
    env = _tuning.environment(CPU)
    ctx = multiprocessing.get_context("fork")
    procs = [ctx.Process(target=_write_entries, args=(str(tmp_path), env, w, 15)) for w in range(4)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(60)
        assert p.exitcode == 0
    entries = _tuning.TuningCache(env, tmp_path).entries()
    assert sorted(entries) == sorted(f"op|w{w}-{i}" for w in range(4) for i in range(15))
    assert not list(tmp_path.glob("*.tmp"))  # every temporary file was renamed or removed


# --------------------------------------------------------------------------------- when nothing is timed
def test_cpu_and_the_interpreter_time_nothing_and_take_the_first_candidate(tmp_path):
    launch, calls = launches()
    with _tuning.overridden(timer=NoTimer(), cache_dir=tmp_path):  # default: timing on CUDA only
        assert _tuning.choose("op_h", 1, CANDIDATES, launch, CPU, module=__name__) == CANDIDATES[0]
    assert calls == [] and not list(tmp_path.iterdir())


@pytest.mark.parametrize("how", ["env", "switch"])
def test_the_switch_keeps_the_static_table_even_with_a_cached_choice(cpu_tuning, monkeypatch, how):
    launch, _ = launches()
    with cpu_tuning(FakeTimer(wide=0.5)):
        _tuning.choose("op_i", 1, CANDIDATES, launch, CPU, module=__name__)
    if how == "env":
        monkeypatch.setenv(_tuning.ENV_SWITCH, "0")
    with cpu_tuning(NoTimer(), **({"enabled": False} if how == "switch" else {})):
        assert _tuning.choose("op_i", 1, CANDIDATES, launch, CPU, module=__name__) == CANDIDATES[0]


def test_nothing_is_timed_while_compiling_or_capturing_but_the_cache_is_used(cpu_tuning, monkeypatch):
    launch, _ = launches()
    with cpu_tuning(FakeTimer(wide=0.5)):
        _tuning.choose("op_j", 1, CANDIDATES, launch, CPU, module=__name__)
    monkeypatch.setattr(torch.compiler, "is_compiling", lambda: True)
    with cpu_tuning(NoTimer()):
        assert _tuning.choose("op_j", 1, CANDIDATES, launch, CPU, module=__name__) == CANDIDATES[1]  # cached
        assert _tuning.choose("op_j", 2, CANDIDATES, launch, CPU, module=__name__) == CANDIDATES[0]  # static
    monkeypatch.setattr(torch.compiler, "is_compiling", lambda: False)
    monkeypatch.setattr(_tuning, "interpreter_active", lambda: False)  # as on a GPU machine
    with cpu_tuning(NoTimer()):
        assert _tuning.can_time(torch.device("cuda"))
        monkeypatch.setattr(_tuning, "_capturing", lambda: True)
        assert not _tuning.can_time(torch.device("cuda"))


def test_under_distributed_nothing_is_timed_lazily_only_broadcast_choices_apply(cpu_tuning, monkeypatch):
    launch, _ = launches()
    monkeypatch.setattr(_tuning, "distributed_world", lambda: 2)
    with cpu_tuning(NoTimer()):
        assert _tuning.choose("op_k", 1, CANDIDATES, launch, CPU, module=__name__) == CANDIDATES[0]
        _tuning.install_decisions({_tuning.entry_key("op_k", 1): repr(CANDIDATES[2])})  # rank 0's choice
        assert _tuning.choose("op_k", 1, CANDIDATES, launch, CPU, module=__name__) == CANDIDATES[2]


def test_the_source_hash_covers_inlined_helper_modules():
    import vit_fast.kernels.layer_norm  # noqa: F401

    modules = _tuning._kernel_modules("vit_fast.kernels.layer_norm")
    assert "vit_fast.kernels.layer_norm" in modules and "vit_fast.kernels._utils" in modules
    assert len(_tuning.source_hash("vit_fast.kernels.layer_norm")) == 16


# ------------------------------------------------------------------------------------ compile ahead
class FakeKernel:
    """A jit kernel's launch surface: ``kernel[grid](...)`` runs, ``kernel.warmup(..., grid=)`` compiles only."""

    def __init__(self):
        self.runs, self.warmups = [], []

    def __getitem__(self, grid):
        return lambda *args, **kwargs: self.runs.append((grid, args))

    def warmup(self, *args, grid, **kwargs):
        self.warmups.append((grid, args))


class FakeAsyncCompileMode:
    entered = []

    def __init__(self, executor, ignore_errors=False):
        self.executor, self.ignore_errors = executor, ignore_errors

    def __enter__(self):
        FakeAsyncCompileMode.entered.append(self)
        return self

    def __exit__(self, *exc):
        return False


def test_compile_ahead_warms_every_candidate_under_async_compile(cpu_tuning, monkeypatch):
    """On CUDA every candidate's launches become warmups (with their grids) under Triton's AsyncCompileMode with a
    thread pool, errors included; an op launched inside (a nested ``choose``) takes its static config untimed; the
    flag is off afterwards. CPU, one candidate or VIT_FAST_PARALLEL_COMPILE=0 compile nothing ahead."""
    import triton

    monkeypatch.setattr(triton, "AsyncCompileMode", FakeAsyncCompileMode, raising=False)
    monkeypatch.setattr(_tuning, "interpreter_active", lambda: False)
    FakeAsyncCompileMode.entered.clear()
    kernel, inner = FakeKernel(), []
    cuda = torch.device("cuda")

    def launch(cfg):
        _tuning.launcher(kernel, (cfg[1],))(cfg[0])
        inner.append(_tuning.choose("inner_op", cfg, CANDIDATES, lambda c: None, cuda))
        if cfg[0] == "wide":
            raise RuntimeError("a candidate that fails while compiling ahead")

    with cpu_tuning(NoTimer()):
        _tuning._compile_ahead(CANDIDATES, launch, cuda)
    assert kernel.warmups == [((64,), ("static",)), ((128,), ("wide",)), ((32,), ("narrow",))] and not kernel.runs
    (mode,) = FakeAsyncCompileMode.entered
    assert mode.ignore_errors and mode.executor._max_workers >= 1
    assert inner == [CANDIDATES[0]] * 3 and not _tuning._warming.on
    _tuning.launcher(kernel, (8,))("after")
    assert kernel.runs == [((8,), ("after",))]
    for device, candidates, env in ((CPU, CANDIDATES, "1"), (cuda, CANDIDATES[:1], "1"), (cuda, CANDIDATES, "0")):
        monkeypatch.setenv(_tuning.ENV_PARALLEL_COMPILE, env)
        _tuning._compile_ahead(candidates, launch, device)
    assert len(kernel.warmups) == 3 and len(FakeAsyncCompileMode.entered) == 1


_FAKE_DRIVER_SCRIPT = r"""
import os, sys
import torch, triton
from triton.backends.compiler import GPUTarget
from triton.runtime import driver

class FakeDriver:  # what JITFunction.run asks a driver before compiling; no launch is possible
    def get_current_device(self): return 0
    def get_current_stream(self, device=None): return 0
    def get_current_target(self): return GPUTarget("cuda", 90, 32)
    def get_active_torch_device(self): return torch.device("cpu")
    def get_device_interface(self): return torch.cuda
driver.set_active(FakeDriver())

from vit_fast.kernels import _tuning, linear_act as la
m, k, n = 256, 768, 3072
x, w, b = torch.randn(m, k).bfloat16(), torch.randn(n, k).bfloat16(), torch.randn(n)
h, d = torch.empty(m, n, dtype=torch.bfloat16), torch.empty(m, n, dtype=torch.bfloat16)
candidates = la._candidates(la.linear_act_config(torch.bfloat16, 90).fwd, torch.bfloat16, 90, False, False, True)
_tuning._compile_ahead(candidates, lambda t: la.launch_fwd(h, d, x, w, b, "gelu", True, t), torch.device("cuda"))
cache = la._linear_act_fwd_kernel.device_caches[0][0]
print(len(candidates), len(cache), sorted({type(kernel).__name__ for kernel in cache.values()}))
"""


@pytest.mark.slow
def test_compile_ahead_compiles_the_real_kernels_for_sm90_without_a_gpu(tmp_path):
    """Triton's own JIT path (not the interpreter) behind a driver that only names an sm_90 target: compiling
    linear_act's forward candidates ahead leaves one compiled kernel per candidate in the jit cache, launched
    never (this driver could not launch)."""
    import os
    import subprocess
    import sys

    env = {key: value for key, value in os.environ.items() if key != "TRITON_INTERPRET"}
    env["TRITON_CACHE_DIR"] = str(tmp_path / "triton")
    out = subprocess.run([sys.executable, "-c", _FAKE_DRIVER_SCRIPT], env=env, capture_output=True, text=True,
                         timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.split()[-3:] == ["4", "4", "['CompiledKernel']"], out.stdout


_DIRECT_LAUNCH_SCRIPT = r"""
import torch
from triton.backends.compiler import GPUTarget
from triton.runtime import driver
from triton.runtime.jit import JITFunction

launched = []  # (kernel, arguments) of every launch the compiled kernels' launcher received


class FakeUtils:
    def load_binary(self, name, kernel, shared, device): return 1, 1, 64, 0, 1024
    def get_device_properties(self, device): return {"max_shared_mem": 232448, "multiprocessor_count": 132}


current_device = [0]


class FakeDriver:  # compiles for sm_90; its launcher records the arguments instead of launching
    utils = FakeUtils()
    def get_current_device(self): return current_device[0]
    def get_current_stream(self, device=None): return 7
    def get_current_target(self): return GPUTarget("cuda", 90, 32)
    def get_active_torch_device(self): return torch.device("cpu")
    def get_device_interface(self): return torch.cuda
    def launcher_cls(self, src, metadata): return lambda *args: launched.append((src.fn.__name__, args))
driver.set_active(FakeDriver())

jit_runs = []
real_run = JITFunction.run
JITFunction.run = lambda self, *a, **kw: jit_runs.append(self.__name__) or real_run(self, *a, **kw)

from vit_fast.kernels import bias_gelu as bg, layer_norm as ln, linear_act as la
from vit_fast.kernels.attention import interface as AI


def alike(x, y):  # a tensor the launch makes (the partial sums) is new each call: its layout
    if isinstance(x, torch.Tensor):
        return isinstance(y, torch.Tensor) and (x is y or (x.shape, x.stride(), x.dtype) == (y.shape, y.stride(),
                                                                                              y.dtype))
    return type(x) is type(y) and x == y


def twice(name, launch, *args):
    runs, start = len(jit_runs), len(launched)
    launch(*args)
    middle, kernels = len(launched), len(jit_runs) - runs
    launch(*args)
    first, second = launched[start:middle], launched[middle:]
    assert kernels >= 1 and len(first) == len(second) == kernels and len(jit_runs) == runs + kernels, name
    for (kernel, a), (again, b) in zip(first, second):  # a[6]: the launch metadata, made per launch
        assert kernel == again and len(a) == len(b) and type(a[6]) is type(b[6]), name
        assert all(alike(x, y) for i, (x, y) in enumerate(zip(a, b)) if i != 6), (name, a, b)
    print(name, len(first))


bf16 = torch.bfloat16
m, n, hid = 64, 768, 1024
x, dy, w, b = torch.randn(m, n, dtype=bf16), torch.randn(m, n, dtype=bf16), torch.ones(n), torch.zeros(n)
y, h, dh, dx = (torch.empty(m, n, dtype=bf16) for _ in range(4))
mean, rstd = torch.empty(m), torch.empty(m)
fwd = ln._fwd_plan(x, x, None, None, None, 0.0, None).launch
twice("layer_norm_fwd", fwd.bind(fwd.candidates[0]), y, h, mean, rstd, x, x, w, b, None, None, None, 1e-6, None, 0.0)
runs = len(jit_runs)  # an output 2 bytes off 16-byte alignment: Triton would specialize the kernel otherwise
odd = torch.empty(m * n + 1, dtype=bf16)[1:].view(m, n)
fwd.bind(fwd.candidates[0])(odd, h, mean, rstd, x, x, w, b, None, None, None, 1e-6, None, 0.0)
assert len(jit_runs) == runs + 1, "a misaligned tensor launched directly"
bwd = ln._bwd_plan(dy, None, h, x, w, b, None, None, None, 0.0, True, 90).launch
twice("layer_norm_bwd", bwd.bind(bwd.candidates[0]), dh, dx, dy, None, h, x, w, None, None, None, mean, rstd, None,
      0.0)
w1, b1, w2 = torch.randn(hid, n, dtype=bf16), torch.randn(hid), torch.randn(n, hid, dtype=bf16)
h1, dact, du = (torch.empty(m, hid, dtype=bf16) for _ in range(3))
twice("linear_act_fwd", la._fwd_plan(x, w1, b1, "gelu", True, "ieee", 90, False).bind(
    la.linear_act_config(bf16, 90).fwd), h1, dact, x, w1, b1)
twice("linear_act_bwd", la._bwd_plan(dy, dact, w2, torch.float32, "ieee", 90, False).bind(
    la.linear_act_config(bf16, 90).bwd), du, dy, w2, dact)
first = lambda plan: plan.bind(plan.candidates[0])  # noqa: E731
twice("bias_gelu_fwd", first(bg._gelu_fwd_plan(h1, True, "none")), dact, h1, b1)
twice("bias_gelu_bwd", first(bg._gelu_bwd_plan(h1, h1, torch.float32, "none")), du, h1, h1, b1)
gamma, scale = torch.ones(n), torch.ones(4)
twice("bias_dropout_add_fwd", first(bg._add_fwd_plan(x, dy, b, gamma, scale, 0.1)), y, x, b, dy, gamma, scale,
      torch.zeros(1, dtype=torch.int64), 0.1)
twice("bias_dropout_add_bwd", first(bg._add_bwd_plan(dy, x, b, gamma, scale, 0.1, True)), dx, dy, x, b, gamma, scale,
      torch.zeros(1, dtype=torch.int64), 0.1)
B, N, H = 2, 197, 2
qkv, dqkv = torch.randn(B, N, 3 * H * 64, dtype=bf16), torch.empty(B, N, 3 * H * 64, dtype=bf16)
(q, k, v), (dq, dk, dv) = AI._split_packed(qkv, H), AI._split_packed(dqkv, H)
out, do = (AI._heads_view(torch.randn(B, N, H * 64, dtype=bf16), H) for _ in range(2))
lse = torch.empty(B, H, N)
fwd = AI._flash_plan("attention_fwd", (q, k, v, out), N, 0.0, "ieee", 90).launch
twice("attention_fwd", fwd.bind(fwd.candidates[0]), q, k, v, out, lse, 0.125, None)
bwd = AI._flash_plan("attention_bwd", (q, k, v, out, do, dq, dk, dv), N, 0.0, "ieee", 90).launch
twice("attention_bwd", bwd.bind(bwd.candidates[0]), do, q, k, v, out, lse, dq, dk, dv, 0.125, None)
with AI.stored_ds_only():
    bwd = AI._flash_plan("attention_bwd", (q, k, v, out, do, dq, dk, dv), N, 0.0, "ieee", 90).launch
twice("attention_bwd_stored_ds", bwd.bind(bwd.candidates[0]), do, q, k, v, out, lse, dq, dk, dv, 0.125, None)


def same_launches(name, first, second):  # pointers, not views: the packed launchers pass column slices
    runs = len(launched)
    first()
    middle = len(launched)
    second()
    a_launches, b_launches = launched[runs:middle], launched[middle:]
    assert len(a_launches) == len(b_launches) >= 1, name
    for (kernel, a), (again, b) in zip(a_launches, b_launches):
        assert kernel == again and len(a) == len(b), name
        for i, (x, y) in enumerate(zip(a, b)):
            if isinstance(x, torch.Tensor) and i != 6:  # the same memory, or a workspace made per call
                assert isinstance(y, torch.Tensor) and x.dtype == y.dtype and (
                    x.data_ptr() == y.data_ptr() or (x.shape, x.stride()) == (y.shape, y.stride())), (name, i)
            elif i != 6:
                assert alike(x, y), (name, i, x, y)
    print(name, len(a_launches))


packed_out, grad_out = torch.randn(B, N, H * 64, dtype=bf16), torch.randn(B, N, H * 64, dtype=bf16)
same_launches("attention_fwd_packed",
              lambda: AI._launch_fwd(q, k, v, AI._heads_view(packed_out, H), lse, 0.125, 0.0, None),
              lambda: AI._launch_packed_fwd(qkv, packed_out, lse, H, 0.125, 0.0, None))
for only in (AI.one_launch_only, AI.stored_ds_only):
    with only():
        same_launches("attention_bwd_packed",
                      lambda: AI._launch_bwd(AI._heads_view(grad_out, H), q, k, v, AI._heads_view(packed_out, H), lse,
                                             dq, dk, dv, 0.125, 0.0, None),
                      lambda: AI._launch_packed_bwd(grad_out, qkv, packed_out, lse, dqkv, H, 0.125, 0.0, None))
from vit_fast.kernels import swiglu as sw
gate, value = torch.randn(m, hid, dtype=bf16), torch.randn(m, hid, dtype=bf16)
twice("swiglu_fwd", sw.swiglu_fwd.function, gate, value)
twice("swiglu_bwd", sw.swiglu_bwd.function, dy[:, :1].expand(m, hid).contiguous(), gate, value, 1)

import os, sys
from vit_fast.kernels import _tuning
sys.path.insert(0, os.environ["EDGE_KERNEL_DIR"])
from edge_kernel import scaled
x = torch.zeros(32)


def goes_direct(first, second, grid=(1,), between=lambda: None, **constexprs):
    launch = _tuning.KernelLaunch(scaled, grid, BLOCK=32, **constexprs)
    launch(*first)
    between()
    runs = len(jit_runs)
    launch(*second)
    current_device[0] = 0
    return len(jit_runs) == runs


print("edges", goes_direct((x, 8, 0, 0.5), (x, 8, 0, 0.5), SCALE=1.0),  # the control: direct
      goes_direct((x, 8, True, 0.5), (x, 8, 1, 0.5), SCALE=1.0),  # a bool then an int: Triton's u1 then i32
      goes_direct((x, 8, 0, 2), (x, 8, 0, 2.0), SCALE=1.0),  # an int then a float
      goes_direct((x, 8, 0, 0.5, 0.5), (x, 8, 0, 0.5, 0.25)),  # a constexpr float passed positionally
      goes_direct((x, 8, 0, 0.5), (x, 8, 0, 0.5), grid=lambda meta: (1,), SCALE=1.0),  # a callable grid
      goes_direct((x, 8, 0, 0.5), (x, 8, 0, 0.5), between=lambda: current_device.__setitem__(0, 1), SCALE=1.0))
"""

_EDGE_KERNEL = """
import triton
import triton.language as tl


@triton.jit
def scaled(X, n, flag, s, SCALE: tl.constexpr, BLOCK: tl.constexpr):
    offs = tl.arange(0, BLOCK)
    x = tl.load(X + offs, mask=offs < n)
    tl.store(X + offs, x * s * SCALE + flag, mask=offs < n)
"""


@pytest.mark.slow
def test_direct_launches_hand_the_launcher_what_the_jit_does(tmp_path):
    """``KernelLaunch`` behind a driver that compiles for sm_90 and records what the compiled kernels' launcher
    receives: for LayerNorm, linear_act, bias_gelu, bias_dropout_add, flash attention and swiglu, forward and
    backward (the partial sums' launches and the stored-dS backward's two included), the second call of a bound
    launch skips Triton's JIT and hands the launcher the same grid, stream and arguments, constexprs included, as
    the first; a tensor whose alignment Triton would specialize otherwise goes through the JIT again, and so do a
    bool then an int, an int then a float, another value of a constexpr passed positionally, a callable grid and
    another current device."""
    import os
    import subprocess
    import sys

    env = {key: value for key, value in os.environ.items() if key not in ("TRITON_INTERPRET", "VIT_FAST_DIRECT_LAUNCH")}
    env["TRITON_CACHE_DIR"] = str(tmp_path / "triton")
    (tmp_path / "edge_kernel.py").write_text(_EDGE_KERNEL)
    env["EDGE_KERNEL_DIR"] = str(tmp_path)
    out = subprocess.run([sys.executable, "-c", _DIRECT_LAUNCH_SCRIPT], env=env, capture_output=True, text=True,
                         timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.split() == ["layer_norm_fwd", "1", "layer_norm_bwd", "2", "linear_act_fwd", "1",
                                  "linear_act_bwd", "2", "bias_gelu_fwd", "1", "bias_gelu_bwd", "2",
                                  "bias_dropout_add_fwd", "1", "bias_dropout_add_bwd", "2", "attention_fwd", "1",
                                  "attention_bwd", "1",
                                  "attention_bwd_stored_ds", "2", "attention_fwd_packed", "1",
                                  "attention_bwd_packed", "1", "attention_bwd_packed", "2", "swiglu_fwd", "1",
                                  "swiglu_bwd", "1",
                                  "edges", "True", "False", "False", "False", "False", "False"], out.stdout


def test_kernel_launch_never_goes_direct_in_the_interpreter(monkeypatch):
    """Under the interpreter (this suite on CPU) every launch is the JIT's, whatever the launch returns."""
    monkeypatch.setattr(_tuning, "interpreter_active", lambda: True)
    calls = []

    class Compiled:
        def __getitem__(self, grid):
            raise AssertionError("went direct")

    from triton.runtime.jit import JITFunction

    class Kernel(JITFunction):  # a compiled kernel's type, so only the interpreter check refuses
        params = ()

        def __init__(self):
            pass

        def __getitem__(self, grid):
            return lambda *args, **constexprs: calls.append((grid, args, constexprs)) or Compiled()
    launch = _tuning.KernelLaunch(Kernel(), (3,), BLOCK=16, num_warps=4)
    for _ in range(3):
        launch(torch.empty(4), 4, 0.5, None)
    assert launch.direct is None and len(calls) == 3 and calls[0][0] == (3,) and calls[0][2] == dict(BLOCK=16,
                                                                                                    num_warps=4)


def test_kernel_launch_asks_once_when_the_jit_runs_for_good(monkeypatch):
    """An interpreted or wrapped kernel (not a JITFunction) or a callable grid never goes direct: decided at the
    first call, not asked again per launch (the interpreter's host-cost meter would count the asking)."""
    from triton.runtime.jit import JITFunction

    asked, calls = [], []
    real = _tuning.KernelLaunch._direct
    monkeypatch.setattr(_tuning.KernelLaunch, "_direct", lambda self, *a: asked.append(1) or real(self, *a))

    class Wrapped:
        params = ()

        def __getitem__(self, grid):
            return lambda *args, **constexprs: calls.append(grid)

    class Jitted(JITFunction):
        __getitem__ = Wrapped.__getitem__

        def __init__(self):
            self.params = ()
    for kernel, grid in ((Wrapped(), (3,)), (Jitted(), lambda meta: (3,))):
        asked.clear()
        launch = _tuning.KernelLaunch(kernel, grid, BLOCK=16)
        for _ in range(3):
            launch(torch.empty(4), 4)
        assert launch.direct is False and asked == [1]
    assert len(calls) == 6


# ------------------------------------------------------------------------------------ per-fusion choice
def tiny_model(**overrides):
    torch.manual_seed(0)
    model = vit_fast.create_model("vit_tiny_patch16_224", **{**TINY, **overrides}, backend="auto")
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("bias") or "norm" in name or name in ("cls_token", "reg_token"):
                p.add_(0.1 * torch.randn_like(p))
    return model


def test_tune_model_applies_the_faster_path_per_fusion_prints_the_table_and_caches_it(cpu_tuning):
    model = tiny_model()
    timer = FakeTimer(**{"attention:eager": 0.5, "mlp:eager": 0.7, "attention:fused": 1.0, "mlp:fused": 1.4,
                         "join:fused": 0.2, "patch_embed:fused": 0.3})
    with cpu_tuning(timer):
        result = tuning.tune_model(model, batch_size=2, dtype=torch.float32)
    assert result.timed and result.choices == {"patch_embed": "fused", "attention": "eager", "mlp": "eager",
                                               "join": "fused"}
    assert all(b.attn.impl == "eager" and b.mlp.impl == "eager" and b.join_impl == "fused" for b in model.blocks)
    assert model.patch_embed.impl == "fused" and vit_fast.route_of(model).source == "vit-fast tune"
    # every implementation of every part timed: fused | eager, fused | short | sdpa | eager, fused | bias_gelu | eager
    assert len([label for label in timer.labels if label.startswith("fusion:")]) == 11
    rows = {r.op: r for r in result.fusions}
    assert rows["attention"].candidates == ("fused", "short", "sdpa", "eager")
    assert rows["attention"].speedup == pytest.approx(2.0) and rows["join"].speedup == pytest.approx(5.0)
    table = tuning.format_table(result)
    for text in ("fusion attention", "1.000 / 1.000 / 1.000 / 0.500 (fused / short / sdpa / eager)", "eager", "2.00x",
                 "fusion join", "5.00x"):
        assert text in table, (text, table)

    fresh = tiny_model()  # optimize(tune=True) applies the cached table: nothing is timed again
    with cpu_tuning(NoTimer()):
        assert vit_fast.optimize(fresh, tune=True) is fresh
    assert tuning.fusion_choices(fresh) == result.choices
    with cpu_tuning(NoTimer()):  # tune=False: the static tables and every fusion
        vit_fast.optimize(fresh, tune=False)
        assert not _tuning.autotune_enabled()
    _tuning.set_autotune(None)
    assert tuning.fusion_choices(fresh) == dict.fromkeys(tuning.FUSIONS, "fused")


def test_without_timing_every_fusion_stays_fused(tmp_path):
    model = tiny_model()
    with _tuning.overridden(timer=NoTimer(), cache_dir=tmp_path):
        result = tuning.tune_model(model, batch_size=2, dtype=torch.float32)
    assert not result.timed and result.choices == dict.fromkeys(tuning.FUSIONS, "fused")
    assert "nothing timed" in tuning.format_table(result)


def test_set_fusion_choices_rejects_unknown_names_and_values():
    model = tiny_model()
    with pytest.raises(ValueError, match="unknown fusion 'softmax'"):
        tuning.set_fusion_choices(model, {"softmax": "eager"})
    with pytest.raises(ValueError, match=r"expected one of \['fused', 'bias_gelu', 'eager'\]"):
        tuning.set_fusion_choices(model, {"mlp": "fast"})
    with pytest.raises(ValueError, match="expected one of"):
        tuning.set_fusion_choices(model, {"join": "sdpa"})


FUSED_KERNELS = {  # fusion -> the kernel entry points its fused path calls (module, name)
    "patch_embed": [("vit_fast.model", "patch_embed_kernel")],
    "attention": [("vit_fast.kernels.attention", "attention_linear"), ("vit_fast.kernels.attention", "attention")],
    "mlp": [("vit_fast.layers.mlp", "linear_act"), ("vit_fast.layers.mlp", "bias_gelu")],
    "join": [("vit_fast.layers.norm", "add_layer_norm"), ("vit_fast.layers.norm", "bias_dropout_add")],
}


LIBRARY_ROUTES = {"sdpa": {"attention": "sdpa"}, "bias_gelu": {"mlp": "bias_gelu"},
                  "both": {"attention": "sdpa", "mlp": "bias_gelu"}}


@pytest.mark.parametrize("eager,dtype", [(("patch_embed",), torch.float32), (("attention",), torch.float32),
                                         (("mlp",), torch.float32), (("join",), torch.float32),
                                         (tuple(tuning.FUSIONS), torch.float32),
                                         (tuple(tuning.FUSIONS), torch.bfloat16),
                                         ("sdpa", torch.float32), ("bias_gelu", torch.float32),
                                         ("both", torch.bfloat16)])
def test_forcing_each_fusion_choice_keeps_logits_and_gradients_within_bounds(eager, dtype, monkeypatch):
    """Each fusion forced to its eager path (the others fused; and all eager, also under bf16 autocast), and
    the library routes (attention through SDPA on the packed qkv, the MLP as cuBLAS fc1 + the bias_gelu
    kernel), kernels in the interpreter: logits and every parameter gradient against the float64 reference
    within `vit-fast check`'s bound; the replaced kernels are never called."""
    import importlib

    model = tiny_model(init_values=0.1)
    ref = copy.deepcopy(model).set_backend("torch").double()
    choices = LIBRARY_ROUTES[eager] if isinstance(eager, str) else dict.fromkeys(eager, "eager")
    tuning.set_fusion_choices(model, choices)
    refused = {op: FUSED_KERNELS[op] if impl != "bias_gelu" else [("vit_fast.layers.mlp", "linear_act")]
               for op, impl in choices.items()}
    for op in choices:
        for module, name in refused[op]:
            def refuse(*args, _name=name, **kwargs):
                raise AssertionError(f"{_name} called with the eager path chosen")
            monkeypatch.setattr(importlib.import_module(module), name, refuse)
    x = torch.randn(2, 3, 32, 32)
    with torch.autocast("cpu", dtype=dtype, enabled=dtype != torch.float32):
        out = model(x)
    out_ref = ref(x.double())
    rtol = bound(dtype, "dot")
    assert_close(out, out_ref, rtol, "logits")
    out.square().mean().backward()
    out_ref.square().mean().backward()
    for (name, p), (_, q) in zip(model.named_parameters(), ref.named_parameters()):
        assert_close(p.grad, q.grad, rtol, name)


@pytest.mark.parametrize("mlp_layer", ["swiglu_packed", "swiglu"])
def test_eager_mlp_choice_also_routes_swiglu_mlps(mlp_layer, monkeypatch):
    """'mlp': 'eager' on a SwiGLU model runs SiLU(gate) * value in torch ops: the swiglu kernels are never
    called, and the logits match the float64 reference."""
    import vit_fast.layers.mlp as mlp_module

    model = tiny_model(mlp_layer=mlp_layer)
    ref = copy.deepcopy(model).set_backend("torch").double()
    tuning.set_fusion_choices(model, {"mlp": "eager"})
    assert tuning.fusion_choices(model)["mlp"] == "eager"
    for name in ("swiglu", "swiglu_packed"):
        monkeypatch.setattr(mlp_module, name, lambda *a, _name=name, **k: pytest.fail(f"{_name} called"))
    x = torch.randn(2, 3, 32, 32)
    assert_close(model(x), ref(x.double()), bound(torch.float32, "dot"), "logits")


def _ddp_worker(rank: int, store: str, out_dir: str) -> None:
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=2)
    try:
        model = tiny_model()
        timer = FakeTimer(**{"attention:eager": 0.5, "narrow": 0.1}) if rank == 0 else NoTimer()
        with _tuning.overridden(timer=timer, device_types=("cpu",), cache_dir=f"{out_dir}/cache{rank}"):
            result = tuning.tune_model(model, batch_size=2, dtype=torch.float32)
            chosen = _tuning.decisions()
        with open(f"{out_dir}/rank{rank}.json", "w") as f:
            json.dump({"choices": result.choices, "flags": tuning.fusion_choices(model), "decisions": chosen}, f)
    finally:
        dist.destroy_process_group()


def test_under_ddp_rank0_measures_and_every_rank_ends_with_its_choices(tmp_path):
    import torch.multiprocessing as mp

    mp.start_processes(_ddp_worker, args=(str(tmp_path / "store"), str(tmp_path)), nprocs=2, start_method="spawn")
    ranks = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2)]
    assert ranks[0] == ranks[1]
    assert ranks[0]["flags"]["attention"] == "eager" and ranks[0]["choices"]["mlp"] == "fused"
    assert not (tmp_path / "cache1").exists()  # rank 1 measured nothing and wrote nothing


def test_the_tune_command_prints_the_table_and_writes_json(tmp_path, capsys):
    from vit_fast.tools import cli

    out = tmp_path / "tune.json"
    assert cli.main(["tune", "--model", "vit_tiny_patch16_224", "--batch", "2", "--dtype", "bf16",
                     "--cache-dir", str(tmp_path), "--json", str(out)]) == 0
    text = capsys.readouterr().out
    assert "vit_tiny_patch16_224, batch 2, bf16" in text and "fusion attention" in text
    data = json.loads(out.read_text())
    assert [r["op"] for r in data["fusions"]] == list(tuning.FUSIONS) and data["timed"] is False
    with pytest.raises(SystemExit):
        cli.main(["tune", "--batch", "0"])


class LastWinsTimer:
    """Runs every candidate twice (as do_bench would) and reports each later call as faster, so the last
    candidate of every list wins: the launchers then run non-static configs."""

    def __init__(self):
        self.labels = []

    def __call__(self, fn, label):
        fn()
        fn()
        self.labels.append(label)
        return 1000.0 - len(self.labels)


def test_every_launcher_tunes_and_its_tuned_configs_keep_the_model_within_bounds(cpu_tuning):
    """Kernels in the interpreter with timing allowed on CPU: every wired launcher times its candidates
    (running each twice, so a launch that is not idempotent would corrupt the result), the last candidate
    wins, and logits and every gradient still match the float64 reference."""
    model = tiny_model(init_values=0.1)
    ref = copy.deepcopy(model).set_backend("torch").double()
    x = torch.randn(2, 3, 32, 32)
    timer = LastWinsTimer()
    with cpu_tuning(timer):
        out = model(x)
        out.square().mean().backward()
        records = _tuning.records()
    ops = {r.op for r in records}
    assert {"patch_embed_fwd", "patch_embed_dweight", "attention_fwd", "attention_bwd", "linear_act_fwd",
            "linear_act_bwd", "layer_norm_fwd", "layer_norm_bwd"} <= ops, ops
    assert all(r.choice == len(r.candidates) - 1 for r in records)
    out_ref = ref(x.double())
    out_ref.square().mean().backward()
    rtol = bound(torch.float32, "dot")
    assert_close(out, out_ref, rtol, "logits")
    for (name, p), (_, q) in zip(model.named_parameters(), ref.named_parameters()):
        assert_close(p.grad, q.grad, rtol, name)


def test_the_bias_gelu_and_bias_dropout_add_launchers_tune_too(cpu_tuning):
    from vit_fast.kernels.bias_gelu import bias_dropout_add, bias_dropout_add_ref, bias_gelu, bias_gelu_ref

    x, bias, res, gamma = (torch.randn(s, dtype=torch.float64).float().requires_grad_() for s in
                           ((3, 50, 192), (192,), (3, 50, 192), (192,)))
    with cpu_tuning(LastWinsTimer()):
        outs = [bias_gelu(x, bias), bias_dropout_add(x, bias, res, 0.0, True, gamma=gamma)]
        for out in outs:
            out.backward(torch.ones_like(out))
        grads = [t.grad.clone() for t in (x, bias, res, gamma)]
        assert {"bias_gelu_fwd", "bias_gelu_bwd", "bias_dropout_add_fwd", "bias_dropout_add_bwd"} <= {
            r.op for r in _tuning.records()}
    x64, bias64, res64, gamma64 = (t.detach().double().requires_grad_() for t in (x, bias, res, gamma))
    refs = [bias_gelu_ref(x64, bias64), bias_dropout_add_ref(x64, bias64, res64, 0.0, True, gamma=gamma64)]
    for ref in refs:
        ref.backward(torch.ones_like(ref))
    for out, ref in zip(outs, refs):
        assert_close(out, ref, bound(torch.float32), "output")
    for got, t in zip(grads, (x64, bias64, res64, gamma64)):
        assert_close(got, t.grad, bound(torch.float32, "dot"), "grad")


def test_the_campaign_stage_fills_its_rows(tmp_path):
    from types import SimpleNamespace

    from vit_fast.tools.tune import campaign_stage

    c = SimpleNamespace(dry_run=True, results={}, progress=lambda message: None, tagged=lambda row: dict(row, gpu="-"))
    with _tuning.overridden(cache_dir=tmp_path):
        status = campaign_stage(c)
    assert status["status"] == "ok" and status["timed"] is False and set(status["fusions"]) == set(tuning.FUSIONS)
    assert [r["op"] for r in c.results["tune"]] == list(tuning.FUSIONS) and status["table_rows"] == len(tuning.FUSIONS)
    assert all(r["gpu"] == "-" for r in c.results["tune"])  # rows tagged like every campaign CSV


def test_tune_model_handles_frozen_parts_and_models_without_class_token(cpu_tuning):
    model = tiny_model(class_token=False, global_pool="avg", pos_embed="none")
    model.patch_embed.requires_grad_(False)
    with cpu_tuning(FakeTimer(**{"patch_embed:eager": 0.1})):
        result = tuning.tune_model(model, batch_size=2, dtype=torch.float32)
    assert result.choices["patch_embed"] == "eager" and model.patch_embed.impl == "eager"


def test_a_forcing_switch_holds_in_other_threads_too():
    """`vit-fast check` and the tests force one candidate with ``with switch():``; autograd runs a CUDA backward on
    its own device thread, so the switch must read on there (thread-local, the GPU's backward tested the pointer
    dgrad while the TMA one was asked for)."""
    import threading

    switch = _tuning.ProcessSwitch()
    seen = []

    def read():
        seen.append(switch.on)

    with switch():
        with switch():
            pass
        worker = threading.Thread(target=read)
        worker.start()
        worker.join()
        seen.append(switch.on)
    read()
    assert seen == [True, True, False]


def test_a_launch_plan_keeps_a_settled_choice_and_forgets_it_with_the_state(cpu_tuning, monkeypatch, tmp_path):
    """``LaunchPlan.choose`` (the launchers' hot path) gives what ``choose`` gives: once decided it no longer asks,
    and a new tuning state (``overridden``), ``set_autotune``, ``install_decisions`` or the switch's environment
    variable make it ask again; a rank of a distributed job keeps its answer until rank 0's broadcast."""
    built = []
    plan = _tuning.LaunchPlan("op_plan", ("key",), CANDIDATES, lambda cfg: built.append(cfg) or (lambda: cfg))
    assert plan.bind(("wide", 128))() == plan.bind(("wide", 128))() == ("wide", 128) and built == [("wide", 128)]
    launch, _ = launches()
    asked = []
    real = _tuning.choose
    monkeypatch.setattr(_tuning, "choose", lambda *a, **k: asked.append(a[0]) or real(*a, **k))
    with cpu_tuning(FakeTimer(static=3.0, wide=1.0, narrow=2.0)) as state:
        assert plan.choose(CPU, launch) == ("wide", 128) and asked == ["op_plan"]
        state.timer = NoTimer()
        asked.clear()
        assert plan.choose(CPU, launch) == ("wide", 128) and asked == []  # memoized
        monkeypatch.setenv(_tuning.ENV_SWITCH, "0")
        assert plan.choose(CPU, launch) == ("static", 64) and asked == ["op_plan"]
        monkeypatch.delenv(_tuning.ENV_SWITCH)
        assert plan.choose(CPU, launch) == ("wide", 128) and asked == ["op_plan"] * 2
        _tuning.install_decisions({})
        assert plan.choose(CPU, launch) == ("wide", 128) and len(asked) == 3
    with cpu_tuning(FakeTimer(static=1.0, wide=3.0, narrow=2.0), cache_dir=tmp_path / "other"):
        assert plan.choose(CPU, launch) == ("static", 64) and len(asked) == 4
        _tuning.set_autotune(False)
        assert plan.choose(CPU, launch) == ("static", 64) and len(asked) == 5
        _tuning.set_autotune(None)
    with cpu_tuning(NoTimer(), device_types=()):  # nothing may be timed on CPU: static, settled at once
        assert plan.choose(CPU, launch) == ("static", 64)
    with cpu_tuning(NoTimer(), cache_dir=tmp_path / "ranks"):
        monkeypatch.setattr(_tuning, "distributed_world", lambda: 2)  # a rank that must not decide alone
        assert plan.choose(CPU, launch) == ("static", 64)
        calls = len(asked)
        # kept: a rank's answer changes only with rank 0's broadcast, which bumps the version
        assert plan.choose(CPU, launch) == ("static", 64) and len(asked) == calls
        _tuning.install_decisions({_tuning.entry_key("op_plan", ("key",)): _tuning.describe(("wide", 128))})
        assert plan.choose(CPU, launch) == ("wide", 128) and len(asked) == calls + 1
        assert plan.choose(CPU, launch) == ("wide", 128) and len(asked) == calls + 1
    forced = []
    monkeypatch.setattr(_tuning, "choose", lambda *a, **k: forced.append(a[0]) or ("narrow", 32))
    assert plan.choose(CPU, launch) == ("narrow", 32) and forced == ["op_plan"]  # a replaced choose is asked


class _CallingTimer:
    """Calls fn ``reps`` times (as do_bench's repetitions vary with the measured time) and reports 1 ms."""

    def __init__(self, reps):
        self.reps = reps

    def __call__(self, fn, label):
        for _ in range(self.reps):
            fn()
        return 1.0


def test_measuring_the_parts_leaves_the_random_generators_as_they_were(cpu_tuning, tmp_path):
    """The timed runs draw dropout seeds and drop-path masks, as many as the timer repeats them: tuning leaves the
    caller's generator where it was, so a run that measured trains with the masks of a run that read the cache."""
    model = tiny_model(drop_path_rate=0.1, proj_drop_rate=0.1, attn_drop_rate=0.1)
    torch.manual_seed(123)
    before = torch.get_rng_state()
    with cpu_tuning(_CallingTimer(2), cache_dir=tmp_path):
        tuning.tune_model(model, batch_size=2, dtype=torch.float32)
    assert torch.equal(torch.get_rng_state(), before)


def test_a_choice_timed_out_of_device_memory_is_not_cached(cpu_tuning, tmp_path):
    """An out-of-memory while timing (the step's peak plus the timer's flush buffer) says nothing lasting about the
    candidates: the static fallback is used in this process and nothing is written to the disk cache."""
    def out_of_memory(fn, label):
        raise torch.cuda.OutOfMemoryError("CUDA out of memory (simulated)")

    with cpu_tuning(out_of_memory, cache_dir=tmp_path / "oom"):
        assert _tuning.choose("op_oom", 1, CANDIDATES, lambda c: None, CPU, module=__name__) == CANDIDATES[0]
        assert _tuning.entry_key("op_oom", 1) not in _tuning.cache_for(CPU).entries()


@pytest.mark.parametrize("failure", ["ptxas", "mlir"])
def test_a_candidate_that_fails_to_build_is_skipped(cpu_tuning, failure):
    """ptxas rejecting a candidate (PTXASError) or an MLIR pass failing on it: that candidate is timed as infinitely
    slow, the others still compete (it was fatal to the first training step)."""
    from triton.runtime import errors

    if failure == "ptxas" and not hasattr(errors, "PTXASError"):
        pytest.skip("this triton has no PTXASError")

    def timer(fn, label):
        if "narrow" in label:
            raise (errors.PTXASError("ptxas fatal (simulated)") if failure == "ptxas"
                   else RuntimeError("PassManager::run failed (simulated)"))
        return 2.0 if "static" in label else 1.0

    with cpu_tuning(timer):
        assert _tuning.choose(f"op_{failure}", 1, CANDIDATES, lambda c: None, CPU, module=__name__) == ("wide", 128)


def test_the_cache_file_is_readable_as_the_umask_allows(cpu_tuning, tmp_path):
    """A cache folder shared between users: the file is created as open() would (mkstemp's is 0600)."""
    umask = os.umask(0o022)
    try:
        with cpu_tuning(FakeTimer(static=1.0, wide=2.0, narrow=3.0), cache_dir=tmp_path / "shared"):
            _tuning.choose("op_mode", 1, CANDIDATES, lambda c: None, CPU, module=__name__)
            path = _tuning.cache_for(CPU).path
    finally:
        os.umask(umask)
    assert path.stat().st_mode & 0o777 == 0o644


def test_a_launcher_rank_before_its_process_group_neither_times_nor_tunes_alone(cpu_tuning, monkeypatch):
    """torchrun sets WORLD_SIZE before the script runs: a rank that launches kernels (or tunes) before
    init_process_group would time on its own GPU and keep its own choices for the whole job. It launches the static
    configs, and tune_model names what to do."""
    monkeypatch.setenv("WORLD_SIZE", "2")
    with cpu_tuning(NoTimer()):
        assert _tuning.choose("op_before_init", 1, CANDIDATES, lambda c: None, CPU, module=__name__) == CANDIDATES[0]
        with pytest.raises(ValueError, match="WORLD_SIZE is 2 but no process group exists"):
            tuning.tune_model(tiny_model(), batch_size=2, dtype=torch.float32)
    monkeypatch.setenv("WORLD_SIZE", "1")
    with cpu_tuning(FakeTimer(static=2.0, wide=1.0, narrow=3.0)):
        assert _tuning.choose("op_before_init", 1, CANDIDATES, lambda c: None, CPU, module=__name__) == ("wide", 128)


def test_broadcast_choices_replace_a_ranks_own(cpu_tuning):
    """install_decisions (rank 0's broadcast) replaces what a rank chose before, so every rank runs rank 0's."""
    with cpu_tuning(FakeTimer(static=2.0, wide=1.0, narrow=3.0)):
        _tuning.choose("op_own", 1, CANDIDATES, lambda c: None, CPU, module=__name__)
        assert _tuning.decisions() == {_tuning.entry_key("op_own", 1): _tuning.describe(("wide", 128))}
        _tuning.install_decisions({_tuning.entry_key("op_other", 1): _tuning.describe(("narrow", 32))})
        assert _tuning.decisions() == {_tuning.entry_key("op_other", 1): _tuning.describe(("narrow", 32))}


def test_rank_0_with_a_cached_route_broadcasts_the_cached_kernel_choices(cpu_tuning, monkeypatch):
    """A distributed job's second run finds the parts' route in the cache and times nothing: rank 0 still broadcasts
    the cached kernel choices of the current kernel sources, so every rank runs the configs the first run did
    (it broadcast none, and every rank fell back to the static configs)."""
    import torch.distributed as dist

    monkeypatch.setattr(_tuning, "distributed_world", lambda: 2)
    monkeypatch.setattr(dist, "is_initialized", lambda: True)
    monkeypatch.setattr(dist, "get_rank", lambda: 0)
    sent = []
    monkeypatch.setattr(dist, "broadcast_object_list", lambda payload, src=0: sent.append(payload[0]))
    with cpu_tuning(FakeTimer(narrow=0.1)):
        first = tuning.tune_model(tiny_model(), batch_size=2, dtype=torch.float32)
    with cpu_tuning(NoTimer()):  # the next job: a fresh state, the same cache folder
        second = tuning.tune_model(tiny_model(), batch_size=2, dtype=torch.float32)
    assert not first.cached and second.cached
    assert sent[0][1] and sent[1][1] == sent[0][1]


def test_a_cached_route_serves_only_models_of_the_same_form(cpu_tuning):
    """The parts' route is cached per model form: dropout and drop-path rates (other kernels, another join), the MLP
    layer and a distillation token (another N) are part of it, so a model that differs in them is measured."""
    with cpu_tuning(FakeTimer()):
        assert not tuning.tune_model(tiny_model(), batch_size=2, dtype=torch.float32).cached
        assert tuning.tune_model(tiny_model(), batch_size=2, dtype=torch.float32).cached
        for other in (dict(drop_path_rate=0.1), dict(proj_drop_rate=0.1), dict(mlp_layer="swiglu_packed")):
            assert not tuning.tune_model(tiny_model(**other), batch_size=2, dtype=torch.float32).cached, other


def test_a_failure_on_rank_0_reaches_every_rank(cpu_tuning, monkeypatch):
    """rank 0 measures for everyone: if that raises, the broadcast carries the error and every rank raises it (the
    others were left waiting in the broadcast, or paired it with rank 0's next collective)."""
    import torch.distributed as dist

    monkeypatch.setattr(_tuning, "distributed_world", lambda: 2)
    monkeypatch.setattr(dist, "is_initialized", lambda: True)
    sent = []

    def broadcast(payload, src=0):
        if sent:  # a peer receives what rank 0 sent
            payload[0] = sent[0]
        else:
            sent.append(payload[0])
    monkeypatch.setattr(dist, "broadcast_object_list", broadcast)

    def broken(fn, label):
        raise ValueError("a part's implementation failed (simulated)")

    for rank in (0, 1):
        monkeypatch.setattr(dist, "get_rank", lambda rank=rank: rank)
        with cpu_tuning(broken), pytest.raises(RuntimeError, match="rank 0 failed.*simulated"):
            tuning.tune_model(tiny_model(), batch_size=2, dtype=torch.float32)


def test_the_join_is_timed_on_the_block_with_the_heaviest_drop_path():
    """timm's linear drop-path schedule leaves block 0 without drop-path: the join's timing must see the per-sample
    scale most blocks apply, so it runs on the block where the rate is highest."""
    model = tiny_model(drop_path_rate=0.2)
    rates = [getattr(b.drop_path1, "drop_prob", 0.0) for b in model.blocks]
    assert rates[0] == 0.0 and rates[-1] == max(rates) > 0
    joined = []
    for index, block in enumerate(model.blocks):
        def spy(*args, _index=index, _join=block._join):
            joined.append(_index)
            return _join(*args)
        block._join = spy
    tuning._benchmarks(model.train(), 2, torch.float32)["join"]()()
    assert joined and set(joined) == {len(model.blocks) - 1}


def test_tuning_where_nothing_can_be_timed_leaves_the_model_following_its_devices_route():
    """optimize(cpu_model, tune=True) measures nothing: the model must not be pinned to the route it had on the
    CPU, but take the measured default of the GPU it is moved to."""
    model = tiny_model()
    result = tuning.tune_model(model, batch_size=2, dtype=torch.float32)
    assert not result.timed and not result.cached and not model.route_explicit
