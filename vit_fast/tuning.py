"""A measured choice per fusion, on the user's GPU: the fused kernel or the eager path it replaces.

For each fusion of a model (the patch embedding, attention, the MLP, the residual join + LayerNorm) the
fused path and its eager alternative are timed forward + backward at the model's shapes (batch, tokens,
width, dtype), on one representative module, and the faster is used for the whole model: a per-module
flag the layers consult (``PatchEmbed.use_fused``, ``Attention.use_fused``, ``Mlp.use_fused``,
``Block.use_fused_join``). The eager alternatives are the layers' own reference code paths run on the
GPU: conv + cat + position add; qkv GEMM with its bias + SDPA; fc1 GEMM with its bias + GELU (cuBLAS
and a separate elementwise op); the bias / LayerScale / dropout / residual adds then F.layer_norm.

While the fused paths run, every kernel launcher picks its measured config (vit_fast.kernels._tuning),
so the table holds both: the per-kernel config choices and the per-fusion choices. The fusion choices
are cached with the kernel choices (same file, same environment key), keyed by the model's shapes,
batch, dtype and the sources of the layers and kernels, so ``vit_fast.optimize(model, tune=True)``
applies what ``vit-fast tune`` measured without timing again. Nothing is timed on CPU or in the
interpreter (every choice stays fused, the static tables stay). Under torch.distributed rank 0 times
and broadcasts its choices (kernel configs and fusions) to every rank.
"""
from __future__ import annotations

import contextlib
import dataclasses
import time
from typing import Any, Callable, Optional

import torch
import torch.nn as nn

from .kernels import _tuning

FUSIONS: dict[str, str] = {  # fusion -> (fused path) vs (eager alternative)
    "patch_embed": "patch_embed kernel | conv + cat + position add",
    "attention": "attention_linear (qkv GEMM + flash attention) | qkv GEMM + SDPA",
    "mlp": "linear_act (fc1 GEMM + bias + act epilogue, fc2 GEMM) | fc1 GEMM with bias + act + fc2 GEMM",
    "join": "add_layer_norm | bias, LayerScale, dropout, residual adds + F.layer_norm",
}
CANDIDATES = ("fused", "eager")
_LAYER_MODULES = ("vit_fast.layers", "vit_fast.kernels.attention", "vit_fast.kernels.linear_act",
                  "vit_fast.kernels.layer_norm", "vit_fast.kernels.patch_embed")


@dataclasses.dataclass(frozen=True)
class FusionRow:
    op: str
    times_ms: Optional[tuple[float, float]]  # (fused, eager); None where nothing was timed
    choice: str  # 'fused' or 'eager'

    @property
    def speedup(self) -> float:
        """The chosen path's speedup over the other one (>= 1 when timed)."""
        if self.times_ms is None:
            return float("nan")
        fused, eager = self.times_ms
        return (eager / fused) if self.choice == "fused" else (fused / eager)


@dataclasses.dataclass
class TuneResult:
    fusions: list[FusionRow]
    kernels: list[_tuning.TuneRecord]
    timed: bool  # False: nothing was measured here (CPU / interpreter / switch off)
    cached: bool  # True: the fusion choices came from the cache
    note: str = ""

    @property
    def choices(self) -> dict[str, str]:
        return {row.op: row.choice for row in self.fusions}


# ------------------------------------------------------------------------------------------- flags
def _vit(model: nn.Module) -> nn.Module:
    from .interop.optimize import vit_fast_model_of

    return vit_fast_model_of(model)


def _flag_targets(vit: nn.Module) -> dict[str, list[tuple[nn.Module, str]]]:
    return {
        "patch_embed": [(vit.patch_embed, "use_fused")],
        "attention": [(b.attn, "use_fused") for b in vit.blocks],
        "mlp": [(b.mlp, "use_fused") for b in vit.blocks],
        "join": [(b, "use_fused_join") for b in vit.blocks],
    }


def set_fusion_choices(model: nn.Module, choices: dict[str, str | bool]) -> None:
    """Apply {'attention': 'eager', 'mlp': 'fused', ...} (or booleans, True = fused) to every module of
    the model; fusions not named keep their flag. Unknown names or values raise ValueError."""
    targets = _flag_targets(_vit(model))
    for op, choice in choices.items():
        if op not in targets:
            raise ValueError(f"unknown fusion {op!r}; expected one of {sorted(targets)}")
        if choice not in (True, False, "fused", "eager"):
            raise ValueError(f"fusion {op!r}: expected 'fused' or 'eager' (or a bool), got {choice!r}")
        fused = choice in (True, "fused")
        for module, attr in targets[op]:
            setattr(module, attr, fused)


def fusion_choices(model: nn.Module) -> dict[str, str]:
    """The current choice per fusion ('fused' or 'eager'; the first module's flag)."""
    return {op: ("fused" if getattr(mods[0][0], mods[0][1], True) else "eager") if mods else "fused"
            for op, mods in _flag_targets(_vit(model)).items()}


# ------------------------------------------------------------------------------------ measuring
def _signature(vit: nn.Module, batch_size: int, dtype: torch.dtype) -> str:
    c = vit.config
    fields = ("img_size", "patch_size", "in_chans", "embed_dim", "num_heads", "mlp_ratio", "qkv_bias", "qk_norm",
              "init_values", "class_token", "reg_tokens", "no_embed_class", "act", "residual_in_fp32")
    shape = ",".join(f"{f}={getattr(c, f, None)!r}" for f in fields)
    param_dtype = vit.patch_embed.proj.weight.dtype
    return f"{shape},params={param_dtype},dtype={dtype},training={vit.training}|batch={batch_size}"


def _source() -> str:
    import importlib

    for name in _LAYER_MODULES:
        importlib.import_module(name)
    return "".join(_tuning.source_hash(name) for name in _LAYER_MODULES)


def _fwd_bwd(fn: Callable[[], Any], inputs: list[torch.Tensor], params: list[torch.Tensor],
             amp: Optional[torch.dtype], device: torch.device) -> Callable[[], None]:
    """A closure running fn forward and backward (gradients of the inputs and parameters, not accumulated
    into .grad) with fixed random output gradients."""
    def forward():
        with torch.autocast(device.type, dtype=amp, enabled=amp is not None):
            outs = fn()
        return [o for o in (outs if isinstance(outs, (tuple, list)) else (outs,)) if o is not None and o.requires_grad]

    grads = [torch.randn_like(o) for o in forward()]
    wrt = [t for t in inputs + params if t is not None and t.requires_grad]

    def run():
        outs = forward()
        if outs and wrt:  # a frozen part (no gradient wanted): forward only
            torch.autograd.grad(outs, wrt, grads, allow_unused=True)
    return run


def _benchmarks(vit: nn.Module, batch_size: int, dtype: torch.dtype) -> dict[str, Callable[[], Callable[[], None]]]:
    """fusion -> builder of its fwd+bwd closure (built with the fusion's flags as currently set)."""
    device = vit.patch_embed.proj.weight.device
    param_dtype = vit.patch_embed.proj.weight.dtype
    amp = dtype if dtype != param_dtype else None
    blk = vit.blocks[0]
    tokens = vit.patch_embed.num_patches + vit.num_prefix_tokens
    width = vit.embed_dim
    residual_dtype = torch.float32 if amp is not None and vit.residual_in_fp32 else dtype
    gen = torch.Generator(device=device).manual_seed(0)

    def act(dt=dtype, shape=(batch_size, tokens, width)):
        return torch.randn(shape, generator=gen, device=device, dtype=dt).requires_grad_()

    x, branch, residual = act(), act(), act(residual_dtype)
    images = torch.randn((batch_size, vit.patch_embed.in_chans, *vit.patch_embed.img_size), generator=gen,
                         device=device, dtype=param_dtype if amp is not None else dtype)

    def params(m):
        return [p for p in m.parameters() if p.requires_grad]

    bias = blk.attn.join_terms()[0]
    join_params = params(blk.norm2) + params(blk.ls1) + ([bias] if bias is not None and bias.requires_grad else [])

    def join():  # the block's first join (attention branch + residual, then norm2), as forward_pair runs it
        return blk._join(branch, residual, blk.attn, blk.ls1, blk.drop_path1, blk.norm2)

    return {
        "patch_embed": lambda: _fwd_bwd(lambda: vit.embed(images), [], [vit.patch_embed.proj.weight,
                                        vit.patch_embed.proj.bias, vit.pos_embed, vit.cls_token], amp, device),
        "attention": lambda: _fwd_bwd(lambda: blk.attn.branch(x), [x], params(blk.attn), amp, device),
        "mlp": lambda: _fwd_bwd(lambda: blk.mlp.branch(x), [x], params(blk.mlp), amp, device),
        "join": lambda: _fwd_bwd(join, [branch, residual], join_params, amp, device),
    }


def measure_fusions(model: nn.Module, batch_size: int, dtype: torch.dtype,
                    fusions: Optional[list[str]] = None) -> list[FusionRow]:
    """Time every fusion fused and eager (fwd + bwd, the model's shapes) and return one row per fusion;
    the model's flags are left as they were. Where nothing may be timed (CPU, interpreter, switch off,
    tracing), each row says 'fused' without times."""
    vit = _vit(model)
    device = vit.patch_embed.proj.weight.device
    names = list(FUSIONS) if fusions is None else fusions
    if not _tuning.can_time(device):
        return [FusionRow(op, None, "fused") for op in names]
    before = fusion_choices(vit)
    rows = []
    builders = _benchmarks(vit, batch_size, dtype)
    try:
        for op in names:
            times = []
            for candidate in CANDIDATES:
                set_fusion_choices(vit, {op: candidate})
                run = builders[op]()
                run()  # warm-up outside the timer: compiles and picks the kernels' configs
                times.append(float(_tuning._state.timer(run, f"fusion:{op}:{candidate}")))
            rows.append(FusionRow(op, (times[0], times[1]), "fused" if times[0] <= times[1] else "eager"))
    finally:
        set_fusion_choices(vit, before)
    return rows


# ----------------------------------------------------------------------------------------- tune
def tune_model(model: nn.Module, batch_size: Optional[int] = None, dtype: Optional[torch.dtype] = None,
               refresh: bool = False) -> TuneResult:
    """Measure (or load from the cache) the per-fusion choices for ``model`` at ``batch_size`` and
    ``dtype`` (the compute dtype: bf16/fp16 run under autocast when the parameters are fp32), apply them
    to the model and return the table. ``None`` for batch/dtype: the newest cached table for this
    model's shapes, else batch 64 in bf16 (fp32 where the GPU has no bf16). ``refresh``: measure again
    even where the cache has an answer (kernel configs included) and overwrite it.

    Under torch.distributed (world size > 1) every rank must call this: rank 0 measures and broadcasts
    its kernel-config and fusion choices; all ranks end with the same ones."""
    vit = _vit(model)
    device = vit.patch_embed.proj.weight.device
    world = _tuning.distributed_world()
    if world > 1:
        result = None
        if torch.distributed.get_rank() == 0:
            with _tuning.overridden(local_in_distributed=True, fresh=False):
                result = _tune_local(vit, device, batch_size, dtype, refresh)
        payload = [None if result is None else (result, _tuning.decisions())]
        torch.distributed.broadcast_object_list(payload, src=0)
        result, chosen = payload[0]
        _tuning.install_decisions(chosen)
    else:
        result = _tune_local(vit, device, batch_size, dtype, refresh)
    set_fusion_choices(vit, result.choices)
    return result


def _default_dtype(device: torch.device) -> torch.dtype:
    if device.type == "cuda" and not torch.cuda.is_bf16_supported():
        return torch.float32
    return torch.bfloat16


def _tune_local(vit: nn.Module, device: torch.device, batch_size: Optional[int], dtype: Optional[torch.dtype],
                refresh: bool) -> TuneResult:
    source = _source()
    cache = _tuning.cache_for(device) if _tuning.may_use_cache() and device.type in _tuning._state.device_types \
        else None
    if cache is not None and not refresh:
        found = _cached_rows(cache, vit, batch_size, dtype, source)
        if found is not None:
            return TuneResult(found, [], timed=False, cached=True, note="from the cache")
    batch_size = 64 if batch_size is None else int(batch_size)
    dtype = _default_dtype(device) if dtype is None else dtype
    if batch_size < 1:
        raise ValueError(f"tune: expected a batch size >= 1, got {batch_size}")
    start = len(_tuning.records())
    context = _tuning.refreshing() if refresh else contextlib.nullcontext()
    with context:
        rows = measure_fusions(vit, batch_size, dtype)
    timed = any(r.times_ms is not None for r in rows)
    if timed and cache is not None:
        sig = _signature(vit, batch_size, dtype)
        cache.put({_tuning.entry_key("fusion:" + r.op, sig): {
            "source": source, "choice": r.choice, "candidates": list(CANDIDATES), "times_ms": list(r.times_ms),
            "written": time.time()} for r in rows})
    note = "" if timed else "nothing timed (no CUDA device, the interpreter, or autotuning off): every fusion fused"
    return TuneResult(rows, _tuning.records()[start:], timed=timed, cached=False, note=note)


def _cached_rows(cache: _tuning.TuningCache, vit: nn.Module, batch_size: Optional[int],
                 dtype: Optional[torch.dtype], source: str) -> Optional[list[FusionRow]]:
    """The cached fusion rows for this model (and batch / dtype where given; else the newest entry)."""
    entries = cache.entries()
    model_part = _signature(vit, 0, torch.float32).split(",dtype=")[0]
    found: dict[str, tuple[float, FusionRow]] = {}
    for op in FUSIONS:
        prefix = _tuning.entry_key("fusion:" + op, model_part)
        best = None
        for key, e in entries.items():
            if not key.startswith(prefix) or e.get("source") != source or e.get("choice") not in CANDIDATES:
                continue
            rest = key[len(prefix):]  # ",dtype=torch.bfloat16,training=True|batch=64"
            if dtype is not None and not rest.startswith(f",dtype={dtype},"):
                continue
            if batch_size is not None and not rest.endswith(f"|batch={int(batch_size)}"):
                continue
            written = float(e.get("written", 0.0))
            times = e.get("times_ms")
            row = FusionRow(op, tuple(times) if isinstance(times, list) and len(times) == 2 else None, e["choice"])
            if best is None or written > best[0]:
                best = (written, row)
        if best is None:
            return None
        found[op] = best
    return [found[op][1] for op in FUSIONS]


# ----------------------------------------------------------------------------------------- table
def format_table(result: TuneResult) -> str:
    """The table `vit-fast tune` prints: op, candidates, times, choice, speedup."""
    lines = [f"{'op':<34} {'candidates':<10} {'times (ms)':<40} {'choice':<40} speedup"]

    def ms(t):
        return "-" if t is None else f"{t:.3f}"

    for r in result.fusions:
        times = "-" if r.times_ms is None else " / ".join(ms(t) for t in r.times_ms)
        speed = "-" if r.times_ms is None else f"{r.speedup:.2f}x"
        lines.append(f"{'fusion ' + r.op:<34} {'2':<10} {times + ' (fused / eager)':<40} {r.choice:<40} {speed}")
    for k in result.kernels:
        times = " / ".join(ms(t) for t in k.times_ms)
        label = k.key if len(k.key) <= 34 else k.key[:31] + "..."
        lines.append(f"{label:<34} {len(k.candidates):<10} {times:<40} "
                     f"{'#%d %s' % (k.choice, k.candidates[k.choice])[:40]:<40} {k.speedup:.2f}x")
    if result.note:
        lines.append(f"({result.note})")
    return "\n".join(lines)


def set_autotune(enabled: Optional[bool]) -> None:
    """Measured kernel configs on (True), off (False: the static tables), or as VIT_FAST_AUTOTUNE says (None)."""
    _tuning.set_autotune(enabled)
