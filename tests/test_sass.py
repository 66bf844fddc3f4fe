"""Instruction cost of tensor-core loops from compiled SASS (vit_fast/tools/sass.py, issue 19 part 1).

Compiles go through `vit-fast report`'s pipeline and on-disk cache (~/.cache/vit_fast/aot or
VIT_FAST_AOT_CACHE): the first run compiles (about a second or more per config and arch), later runs read the cache.
"""
import collections
import functools

import pytest

from vit_fast.tools import report, sass
from vit_fast.tools.sass_reference import TUTORIAL_CONFIGS, matmul_spec


# A hand-written sm_90-style dump: a 3-instruction prologue, a loop closed by a backward branch holding
# 2 HGMMA.64x128x16 and `mufu` MUFU, a retry loop without MMA, and the trap at the end.
def _dump(mufu: int = 1) -> str:
    code = (["MOV R1, c[0x0][0x28]", "S2R R0, SR_TID.X", "ISETP.GE.AND P0, PT, R0, 0x10, PT", ".L_x_1:",
             "HGMMA.64x128x16.F32.BF16 R24, gdesc[UR8], R24", "HGMMA.64x128x16.F32.BF16 R24, gdesc[UR12], R24, gsb0"]
            + ["MUFU.EX2 R3, R3"] * mufu
            + ["IADD3 R4, R4, 0x1, RZ", "ISETP.NE.AND P1, PT, R4, R5, PT", "@P1 BRA `(.L_x_1)", ".L_x_2:",
               "SYNCS.PHASECHK.TRANS64 P0, [UR4], R2", "@!P0 BRA `(.L_x_2)", "EXIT", ".L_x_3:", "BRA `(.L_x_3)"])
    lines, address = ["\tcode for sm_90", "\t\tFunction : k"], 0
    for ins in code:
        if ins.endswith(":"):
            lines.append(ins)
        else:
            lines.append(f"        /*{address:04x}*/                   {ins} ;    /* 0x0 */")
            address += 16
    return "\n".join(lines)


_SASS = _dump()


def test_parse_synthetic_loop():
    cost = sass.analyze(_SASS, arch=90, num_warps=8)
    assert len(cost.loops) == 1  # the retry loop holds no MMA; `BRA self` is no loop
    loop = cost.loops[0]
    assert (loop.start, loop.end, loop.instructions, loop.mma, loop.mufu) == (0x30, 0x80, 6, 2, 1)
    assert loop.mma_kind == "HGMMA.64x128x16"
    # 8 warps = 2 warpgroups, each issuing 2 x (2*64*128*16) FLOPs; 4,096 FLOP/clk per SM
    assert loop.mma_cycles == pytest.approx(2 * 2 * 2 * 64 * 128 * 16 / 4096)
    assert loop.issue_cycles == pytest.approx(6 * 8 / 4)
    assert loop.mufu_cycles == pytest.approx(1 * 32 * 8 / 16)
    assert cost.ceiling == pytest.approx(1.0)
    # the same loop with 64 MUFU per iteration is MUFU-bound
    bound = sass.analyze(_dump(mufu=64), arch=90, num_warps=8).loops[0]
    assert (bound.mufu, bound.instructions) == (64, 69)
    assert bound.bound_by == "MUFU" and bound.ceiling == pytest.approx(256 / (64 * 32 * 8 / 16))


def test_bad_input():
    with pytest.raises(ValueError, match="no function"):
        sass.analyze("not a dump", arch=90, num_warps=4)
    with pytest.raises(ValueError, match="arch must be one of"):
        sass.analyze(_SASS, arch=75, num_warps=4)


def _compiled_ceilings(specs_by_arch) -> dict:
    """{(name, arch, config): SassCost} for AotSpecs compiled through vit-fast report's workers and cache."""
    todo, keys = [], {}
    out = {}
    for arch, specs in specs_by_arch.items():
        for spec in specs:
            key = report.spec_key(spec, arch)
            keys[key] = (spec, arch)
            cached = report._load_cached(f"{report.cache_dir()}/{key}.json")
            if cached is not None:
                out[key] = cached
            else:
                fn = report._python_fn(spec.fn)
                todo.append((key, (fn.__module__, fn.__name__, dict(spec.signature), dict(spec.constexprs),
                                   spec.num_warps, spec.num_stages, arch, tuple(spec.divisible_by_16))))
    import json
    import os

    os.makedirs(report.cache_dir(), exist_ok=True)
    for key, result in report._compile_all(todo, 2, None):
        assert not result.get("error"), result["error"]
        with open(f"{report.cache_dir()}/{key}.json", "w") as f:
            json.dump(result, f)
        out[key] = result
    return {(keys[k][0].name, keys[k][1], report.config_string(keys[k][0])): sass.SassCost.from_dict(r["sass"])
            for k, r in out.items()}


@functools.cache
def _reference_costs():
    specs = {arch: [matmul_spec(*cfg) for cfg in cfgs] + [matmul_spec(*cfgs[0], gelu_a=True)]
             for arch, cfgs in TUTORIAL_CONFIGS.items()}
    return _compiled_ceilings(specs)


@pytest.mark.slow
def test_tutorial_gemm_reads_near_full_ceiling():
    """The tutorial GEMM (measured at 53-86% of peak on GPUs) must not be flagged."""
    costs = {k: c for k, c in _reference_costs().items() if k[0] == "reference_gemm"}
    assert len(costs) == 4
    for key, cost in costs.items():
        assert len(cost.loops) == 1, key
        assert cost.ceiling >= 0.95, (key, cost.worst.describe())
        assert cost.worst.mma_kind.startswith("HGMMA" if key[1] == 90 else "HMMA.16816"), key


@pytest.mark.slow
def test_gemm_with_gelu_on_operand_tile_reads_low():
    """Exact-erf GELU on the A tile inside the K loop: issue-bound on both archs (21% / 42% here)."""
    costs = {k: c for k, c in _reference_costs().items() if k[0] == "reference_gemm_gelu_a"}
    assert len(costs) == 2
    for key, cost in costs.items():
        assert cost.ceiling <= 0.5, (key, cost.worst.describe())
        assert cost.worst.bound_by == "issue" and cost.worst.mufu > 0


# ------------------------------------------------------------------------------------------------------
# Every tensor-core config ViT-B/16 and SigLIP So400m/14 ship (bf16 and fp16, autocast and pure, sm_80 and sm_90;
# So400m: head_dim 72, MLP 4304, patch 14): a ceiling of at least 60%, or 40% with attention dropout (issues 19
# and 20). Grouped by (kernel, arch, dropout) over both presets.
CEILING_PRESETS = ("vit_base_patch16_224", "vit_so400m_patch14_siglip_224")
# Known failures, measured with this analysis (ceiling range over the group's configs). They are strict xfails:
# when a redesign lifts a group above its bar the test XPASSes and fails, and the entry must be removed.
KNOWN_BELOW_BAR = {
    ("attention_fwd", 90, True): "37% (ViT-B; So400m 42-43%): one Philox per 16 scores, but the keep bits cross "
                                 "threads through shared memory into the wgmma layout (about 690 instructions per "
                                 "warp per step against 300 without dropout)",
    ("attention_probs", 90, False): "47%: attention maps for inspection, outside training",
}


@functools.cache
def _shipped_rows():
    rows = report.run_report(CEILING_PRESETS, ("bf16", "fp16"), report.ARCHS, workers=2, tensor_core_only=True)
    groups = collections.defaultdict(list)
    for r in rows:
        assert not r.error, (r.kernel, r.config, r.error)
        groups[(r.kernel, r.arch, "DROPOUT=True" in r.config)].append(r)
    return groups


def _groups():
    # the groups the kernels' aot_specs list, without compiling (cheap); not those the model does not read (the
    # persistent TMA GEMMs, whose flattened loop holds the epilogue: they read 9-25% here, counted per K step)
    entries = report.collect_specs(CEILING_PRESETS, ("bf16", "fp16"), report.ARCHS)
    keys = {(spec.name, arch, spec.constexprs.get("DROPOUT", False) is True)
            for spec, arch, _, _ in entries.values() if spec.has_dot and not spec.not_modelled}
    return sorted(keys)


@pytest.mark.slow
@pytest.mark.parametrize("group", [
    pytest.param(g, marks=pytest.mark.xfail(strict=True, reason=KNOWN_BELOW_BAR[g])) if g in KNOWN_BELOW_BAR else g
    for g in _groups()], ids=lambda g: f"{g[0]}-sm_{g[1]}{'-dropout' if g[2] else ''}")
def test_shipped_tensor_core_configs_reach_ceiling(group):
    bar = 0.40 if group[2] else report.CEILING_BAR
    rows = _shipped_rows()[group]
    assert rows
    low = [(r.dtype, r.config, f"{r.ceiling:.0%}") for r in rows if r.ceiling is None or r.ceiling < bar]
    assert not low, f"{group}: {len(low)} configs below a {bar:.0%} ceiling: {low}"
