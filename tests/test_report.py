"""`vit-fast report`: cuobjdump parsing, occupancy, and the AOT compile gate for the base preset (issue 7).

The base-preset test compiles every config the kernels' tables launch for vit_base_patch16_224 (bf16,
fp16, fp32; sm_80 and sm_90) and fails on any spill, any shared memory over the per-block limit, any
compile error, or a dot compiled without tensor-core instructions. Results are cached on disk
(~/.cache/vit_fast/aot); a cold run compiles in 2 processes.
"""
import functools
import importlib
import sys
import types

import pytest
import torch

import vit_fast
from vit_fast.kernels._aot import TRITON_DTYPE_NAMES, AotSpec
from vit_fast.tools import report

from . import fixture_kernels as fixture

SAMPLE = """
Resource usage:
 Common:
  GLOBAL:0
 Function _mm_kernel:
  REG:255 STACK:424 SHARED:1024 LOCAL:8 CONSTANT[0]:416 TEXTURE:0 SURFACE:0 SAMPLER:0
"""


def test_parse_resource_usage():
    assert report.parse_resource_usage(SAMPLE) == dict(REG=255, STACK=424, SHARED=1024, LOCAL=8)
    with pytest.raises(ValueError, match="REG"):
        report.parse_resource_usage("Resource usage:\n Common:\n  GLOBAL:0\n")


@pytest.mark.parametrize("regs, shared, warps, arch, expected", [
    (32, 0, 4, 80, 64),            # thread-limited: 16 blocks of 4 warps
    (168, 8192, 4, 80, 12),        # register-limited: 65536 / (168*32 -> 5376) = 12 warps = 3 blocks
    (64, 100 * 1024, 4, 80, 4),    # shared-limited: one 100 KB block per 164 KB SM
    (64, 100 * 1024, 4, 90, 8),    # two fit in the H100's 228 KB
    (255, 0, 8, 90, 8),            # 255 regs -> 8192 per warp -> 8 warps
])
def test_occupancy(regs, shared, warps, arch, expected):
    got, frac = report.occupancy(regs, shared, warps, arch)
    assert got == expected and frac == expected / 64


def test_tensor_core_use():
    assert report.tensor_core_use("wgmma.mma_async.sync.aligned.m64n128k16.f32.bf16.bf16 {", 90) == "wgmma"
    assert report.tensor_core_use("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {", 80) == "mma"
    assert report.tensor_core_use("fma.rn.f32 %r1, %r2;", 90) == "NO"


def _fixture_module():
    sig = {"A": "*bf16", "B": "*bf16", "C": "*bf16", "K": "i32",
           "BM": "constexpr", "BN": "constexpr", "BK": "constexpr"}

    def aot_specs(arch, **_):
        return [
            AotSpec("tile_matmul", fixture._tile_matmul_kernel, sig, dict(BM=128, BN=128, BK=64), 4, 3, has_dot=True),
            AotSpec("global_scale", fixture._global_scale_kernel, {"X": "*fp32", "N": "i32", "BLOCK": "constexpr"},
                    dict(BLOCK=128), 4),
        ]
    return types.SimpleNamespace(aot_specs=aot_specs)


_HELPER_SRC = """import triton
import triton.language as tl

SCALE = tl.constexpr({scale})


@triton.jit
def helper(x):
    return {body}


@triton.jit
def unrelated(x):
    return {unrelated}
"""
_KERNEL_SRC = """import triton
import triton.language as tl

import cachekey_helper as H
from cachekey_helper import helper


@triton.jit
def direct_kernel(X, BLOCK: tl.constexpr):
    offs = tl.arange(0, BLOCK)
    tl.store(X + offs, helper(tl.load(X + offs)))


@triton.jit
def module_kernel(X, BLOCK: tl.constexpr):
    offs = tl.arange(0, BLOCK)
    tl.store(X + offs, H.helper(tl.load(X + offs)))
"""


def test_cache_key_covers_inlined_helpers(monkeypatch, tmp_path):
    """The compile-cache key changes when a jit helper the kernel inlines changes (called directly or
    through its module, living in another file) or a constexpr global it reads changes, and stays
    when an unrelated function of the same file changes."""
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setattr(sys, "dont_write_bytecode", True)

    def keys(scale="2.0", body="x * SCALE", unrelated="x + 1.0"):
        (tmp_path / "cachekey_helper.py").write_text(_HELPER_SRC.format(scale=scale, body=body, unrelated=unrelated))
        (tmp_path / "cachekey_kernel.py").write_text(_KERNEL_SRC)
        for name in ("cachekey_helper", "cachekey_kernel"):
            monkeypatch.delitem(sys.modules, name, raising=False)
        importlib.invalidate_caches()
        mod = importlib.import_module("cachekey_kernel")
        sig = {"X": "*fp32", "BLOCK": "constexpr"}
        return [report.spec_key(AotSpec(name, getattr(mod, name), sig, dict(BLOCK=16), 4), 80)
                for name in ("direct_kernel", "module_kernel")]

    base = keys()
    assert base == keys(), "the key is stable for unchanged sources"
    helper_edited = keys(body="x * SCALE * 0.5")
    constant_edited = keys(scale="3.0")
    for edited in (helper_edited, constant_edited):
        assert all(a != b for a, b in zip(base, edited))
    assert keys(unrelated="x - 1.0") == base
    sources = dict(report.inlined_sources(importlib.import_module("cachekey_kernel").module_kernel))
    assert set(sources) == {"cachekey_kernel.module_kernel", "cachekey_helper.helper", "cachekey_helper.SCALE"}


def test_report_quick_mode_covers_one_preset_one_dtype_both_archs():
    args = report.build_parser().parse_args(["--quick"])
    assert args.quick and args.presets is None and args.dtypes is None  # main() fills in the quick lists
    assert report.QUICK_PRESETS == ("vit_base_patch16_224",) and report.QUICK_DTYPES == ("bf16",)
    quick = report.collect_specs(report.QUICK_PRESETS, report.QUICK_DTYPES, report.ARCHS, pure=False)
    uses = {use for _, _, _, us in quick.values() for use in us}
    assert uses == {"vit_base_patch16_224/bf16"}, uses  # autocast only: no " pure" entries
    assert {arch for _, arch, _, _ in quick.values()} == set(report.ARCHS)


def test_persistent_tma_kernels_are_not_modelled_rather_than_rated():
    """The static SASS model counts the persistent TMA GEMMs' epilogue at every K step of their flattened loop: their
    rows read n/a with the reason (they read a 10% ceiling, and --quick's worst config); other kernels keep theirs."""
    quick = report.collect_specs(report.QUICK_PRESETS, report.QUICK_DTYPES, report.ARCHS, pure=False)
    marked = {spec.name for spec, _, _, _ in quick.values() if spec.not_modelled}
    assert marked == {spec.name for spec, _, _, _ in quick.values() if spec.name.endswith("_tma")} and marked
    issue_bound = dict(arch=90, num_warps=8, loops=[dict(start=0, end=1, instructions=400, mma=4, mma_kind="HGMMA",
                                                        flops=1.0, issue_cycles=800.0, mma_cycles=80.0)])
    persistent = report.Row("linear_act_fwd_tma", "BM=128", 90, "bf16", sass=issue_bound,
                            not_modelled="persistent: the epilogue is counted per K step")
    pointer = report.Row("linear_act_fwd", "BM=128", 90, "bf16", sass=issue_bound)
    assert persistent.ceiling is None and pointer.ceiling == pytest.approx(0.1)
    assert report.format_ceiling(persistent) == "n/a (persistent)" and report.format_ceiling(pointer) == "10% issue"
    summary = report.summarize_ceilings([persistent, pointer])
    assert ("linear_act_fwd_tma           sm_90: n/a, 1 configs not modelled (persistent: the epilogue is counted "
            "per K step)") in summary
    assert "1 tensor-core configs analysed, 1 below" in summary and "worst: linear_act_fwd [" in summary


def test_report_sees_good_spilling_and_broken_kernels(monkeypatch, tmp_path):
    """The gate can fail: a spilling tile and a kernel that does not compile are both reported.

    Failures are not cached: the test sees the cache return the compiled row but retry the broken one."""
    monkeypatch.setenv("VIT_FAST_AOT_CACHE", str(tmp_path))
    monkeypatch.setattr(report, "kernel_modules", lambda: [_fixture_module()])
    rows = report.run_report(["vit_tiny_patch16_224"], dtypes=["bf16"], archs=[80], workers=2)
    by_config = {(r.kernel, r.config): r for r in rows}
    spilling = by_config[("tile_matmul", "BM=128 BN=128 BK=64 w4 s3")]
    assert spilling.regs == 255 and spilling.shared_bytes > 0 and spilling.tensor_cores == "mma"
    assert spilling.threads == 128 and 0 < spilling.occupancy <= 1
    assert spilling.spill_bytes > 0 and spilling.problems() == [f"spills {spilling.spill_bytes} B/thread"]
    broken = by_config[("global_scale", "BLOCK=128 w4 s3")]
    assert "_NOT_CONSTEXPR" in broken.error and broken.problems()
    assert "2 compiled configs, 2 with problems" in report.summarize(rows)
    # Successful compiles are cached and reused; errors are not cached (they are retried).
    again = report.run_report(["vit_tiny_patch16_224"], dtypes=["bf16"], archs=[80], workers=2)
    assert [(r.kernel, r.cached) for r in again] == [("global_scale", False), ("tile_matmul", True)]


def test_base_preset_compiles_without_spills_for_sm80_and_sm90():
    assert report.kernel_modules(), "no kernel module exposes aot_specs"
    rows = report.run_report(["vit_base_patch16_224"], dtypes=list(report.DTYPES), archs=list(report.ARCHS), workers=2)
    kernels = {r.kernel for r in rows}
    hopper_only = {k for k in kernels if k.endswith("_tma")}  # TMA kernels: sm_90+ only
    assert {(k, 90) for k in hopper_only} <= {(r.kernel, r.arch) for r in rows}
    assert {(k, a) for k in kernels - hopper_only for a in report.ARCHS} <= {(r.kernel, r.arch) for r in rows}
    dots = [r for r in rows if r.tensor_cores != "-"]
    assert dots and all(r.regs > 0 and r.threads > 0 for r in rows if not r.error)
    bad = [f"{r.kernel} [{r.config}] sm_{r.arch} {r.dtype}: {'; '.join(r.problems())}" for r in rows if r.problems()]
    assert not bad, f"{len(bad)} of {len(rows)} configs fail the GPU-readiness gate:\n" + "\n".join(bad)


def test_report_covers_the_family_presets():
    from vit_fast.family_presets import FAMILY_PRESETS

    assert set(FAMILY_PRESETS) <= set(report.REPORT_PRESETS)
    assert set(report.VIT_PRESETS) <= set(report.REPORT_PRESETS)


# SigLIP So400m/14 (head_dim 72, not a multiple of 16: masked columns in the attention tiles; MLP 4304 at
# ratio 3.7362; patch 14) and DINOv2-g/14 (SwiGLU at width 1536, 518 px, 1370 tokens): the shapes no ViT preset has.
NEW_SHAPE_PRESETS = ("vit_so400m_patch14_siglip_224", "vit_giant_patch14_dinov2")


@functools.cache
def _new_shape_rows(preset):
    return report.run_report([preset], dtypes=["bf16"], archs=list(report.ARCHS), workers=2)


def _gate_failures(rows):
    return [f"{r.kernel} [{r.config}] sm_{r.arch} {r.dtype}: {'; '.join(r.problems())}" for r in rows if r.problems()]


@pytest.mark.slow
@pytest.mark.parametrize("preset", NEW_SHAPE_PRESETS)
def test_family_presets_with_new_shapes_compile_without_spills(preset):
    """Every config So400m and DINOv2-g launch in bf16 (autocast and pure), sm_80 and sm_90, compiles with no
    spill, shared memory within the limit and tensor cores on every dot (about 900 compiles cold for both,
    seconds warm), patch_embed at DINOv2's 518 px images included (its unaligned-image tiles)."""
    rows = _new_shape_rows(preset)
    if preset.startswith("vit_so400m"):
        assert any("D=72" in r.note for r in rows if r.kernel == "attention_fwd")
    bad = _gate_failures(rows)
    assert not bad, f"{len(bad)} of {len(rows)} configs fail the GPU-readiness gate:\n" + "\n".join(bad)


def _recorded_launches(monkeypatch, step):
    """Every Triton launch `step()` makes in the interpreter: (kernel, {argument: value}, num_warps, num_stages)."""
    from triton.backends.nvidia.compiler import CUDAOptions

    from vit_fast._compat import wrap_interpreted_run

    launches = []

    def recording(self, run, *args, grid, warmup, **kwargs):
        values = {**dict(zip(self.arg_names, args)), **{k: v for k, v in kwargs.items() if k in self.arg_names}}
        # what a GPU launch compiles with: Triton's CUDA defaults where the launcher passes nothing
        launches.append((self, values, kwargs.get("num_warps", CUDAOptions.num_warps),
                         kwargs.get("num_stages", CUDAOptions.num_stages)))
        return run(*args, grid=grid, warmup=warmup, **kwargs)

    restore = wrap_interpreted_run(recording)  # InterpretedFunction.run differs across triton versions
    try:
        step()
    finally:
        restore()
    monkeypatch.undo()
    return launches


def _covers(spec: AotSpec, fn, values: dict, warps: int, stages: int) -> bool:
    return (spec.fn is fn and (spec.num_warps, spec.num_stages) == (warps, stages)
            and all(values.get(k) == v for k, v in spec.constexprs.items())
            and all(spec.signature[k] == "*" + TRITON_DTYPE_NAMES[v.dtype]
                    for k, v in values.items() if isinstance(v, torch.Tensor)))


@pytest.mark.parametrize("dtype, overrides", [
    (torch.bfloat16, dict()),
    (torch.bfloat16, dict(residual_in_fp32=False)),
    (torch.bfloat16, dict(init_values=0.1, drop_path_rate=0.2, proj_drop_rate=0.1, attn_drop_rate=0.1,
                          global_pool="avg")),
    (torch.float32, dict(init_values=0.1, drop_path_rate=0.2)),
    ("pure_bf16", dict(init_values=0.1)),
    (torch.bfloat16, dict(route=dict(attention="short"))),
    (torch.bfloat16, dict(attn_drop_rate=0.1, route=dict(attention="short"))),
], ids=["bf16", "bf16_stream", "bf16_layerscale_dropout_avg", "fp32_layerscale", "pure_bf16", "bf16_short",
        "bf16_short_dropout"])
@pytest.mark.parametrize("arch", [80, 90], ids=["sm80", "sm90"])
def test_every_launch_of_a_training_step_is_in_the_aot_report(monkeypatch, dtype, overrides, arch):
    """The report compiles what the model launches: every Triton launch of a fused training step (forward,
    backward) matches an aot_specs entry of the model's shape: kernel, constexprs, num_warps, num_stages
    and the dtype of every tensor argument. The launchers pick their tables for sm_90 too (gpu_arch
    patched): the interpreter runs whatever tiles an H100 would."""
    from vit_fast.kernels import layer_norm, linear_act, patch_embed
    from vit_fast.kernels.attention import interface as attention

    for module in (attention, layer_norm, linear_act, patch_embed):  # the launchers that read the device's arch
        monkeypatch.setattr(module, "gpu_arch", lambda device: arch)
    torch.manual_seed(0)
    overrides = dict(overrides)
    route = overrides.pop("route", None)
    model = vit_fast.create_model("vit_tiny_patch16_224", img_size=32, patch_size=8, embed_dim=64, num_heads=2,
                                  depth=2, num_classes=10, backend="triton", **overrides).train()
    if route:
        vit_fast.apply_route(model, vit_fast.Route(**route, source="test"))
    x = torch.randn(2, 3, 32, 32)
    pure = dtype == "pure_bf16"  # parameters, images and activations all bf16, no autocast
    if pure:
        dtype, model, x = torch.bfloat16, model.bfloat16(), x.bfloat16()

    def step():
        with torch.autocast("cpu", dtype=dtype, enabled=dtype != torch.float32 and not pure):
            out = model(x)
        out.float().square().mean().backward()

    launches = _recorded_launches(monkeypatch, step)
    shape = report.config_shape(model.config)
    # under autocast the fp32 entries too: average pooling's norm (fc_norm) runs on the fp32 stream
    kinds = [dict(dtype=dtype, param_dtype=dtype, images_dtype=dtype)] if pure else \
        [dict(dtype=dt) for dt in {dtype, torch.float32}]
    specs = [spec for mod in report.kernel_modules() for kind in kinds
             for spec in mod.aot_specs(**shape, **kind, arch=arch)]
    assert len(launches) > 10
    missing = {f"{fn.__name__} warps={w} stages={st} "
               + ", ".join(f"{k}={'*' + TRITON_DTYPE_NAMES[v.dtype] if isinstance(v, torch.Tensor) else v}"
                           for k, v in values.items() if isinstance(v, (torch.Tensor, bool)) or k.isupper())
               for fn, values, w, st in launches if not any(_covers(s, fn, values, w, st) for s in specs)}
    assert not missing, "launches no aot_specs entry lists:\n" + "\n".join(sorted(missing))


@pytest.mark.parametrize("pure", [False, True], ids=["bf16_autocast", "pure_bf16"])
@pytest.mark.parametrize("arch", [80, 90], ids=["sm80", "sm90"])
def test_patch_embed_launches_at_unaligned_image_rows_are_in_the_aot_report(monkeypatch, pure, arch):
    """Images whose rows are no multiple of 16 elements (DINOv2's 518 px; here 42 px, patch 14) take
    patch_embed's unaligned tiles, and aot_specs at that image size lists those launches (images with grad)."""
    from vit_fast.kernels import patch_embed as pe

    monkeypatch.setattr(pe, "gpu_arch", lambda device: arch)
    torch.manual_seed(0)
    D, P, S = 64, 14, 42
    dtype = torch.bfloat16
    x = torch.randn(2, 3, S, S, dtype=dtype if pure else torch.float32, requires_grad=True)
    params = [torch.randn(D, 3, P, P), torch.randn(D), torch.randn(1, 1 + 9, D), torch.randn(1, 1, D)]
    params = [p.to(dtype if pure else torch.float32).requires_grad_() for p in params]

    def step():
        with torch.autocast("cpu", dtype=dtype, enabled=not pure):
            out = pe.patch_embed(x, params[0], params[1], params[2], params[3])
        out.float().square().mean().backward()

    launches = _recorded_launches(monkeypatch, step)
    kind = dict(param_dtype=dtype, images_dtype=dtype) if pure else {}
    specs = pe.aot_specs(tokens=10, width=D, dtype=dtype, arch=arch, patch_size=P, img_size=S, batch=2, **kind)
    assert {fn.__name__ for fn, *_ in launches} >= {"_patch_embed_fwd_kernel", "_patch_embed_dimages_kernel"}
    missing = [(fn.__name__, w, st) for fn, values, w, st in launches
               if not any(_covers(s, fn, values, w, st) for s in specs)]
    assert not missing, missing
    assert not pe.images_aligned(x.stride())
    unaligned, aligned = pe.patch_embed_config(arch, dtype, False), pe.patch_embed_config(arch, dtype)
    assert unaligned.fwd != aligned.fwd
    fwd = next(s for s in specs if s.name == "patch_embed_fwd")
    assert (fwd.num_warps, fwd.num_stages) == (unaligned.fwd.num_warps, unaligned.fwd.num_stages)
    assert fwd.constexprs["ROWS"] == unaligned.fwd.block_k // 16
