"""A measured choice per fusion, on the user's GPU: which implementation runs each part of the model.

For each fusion of a model (the patch embedding, attention, the MLP, the residual join + LayerNorm) every
implementation the part has (vit_fast/route.py ``PART_IMPLS``: the fused kernel path, and the library
paths it replaces) is timed forward + backward at the model's shapes (batch, tokens, width, dtype), on
one representative module, and the fastest is used for the whole model: the model's route
(``vit_fast.route.apply_route``) hands each part its implementation. The library paths are the layers'
own code run on the GPU: conv + cat + position add; qkv GEMM + SDPA on the packed qkv (vit_fast/sdpa.py)
or as timm writes it; cuBLAS fc1 + the bias_gelu kernel, or fc1 with its bias + torch's GELU; the bias /
LayerScale / dropout / residual adds then F.layer_norm. Implementations that are not bitwise repeatable
(route.NONDETERMINISTIC) are not timed while torch.use_deterministic_algorithms is on.

While the fused paths run, every kernel launcher picks its measured config (vit_fast.kernels._tuning),
so the table holds both: the per-kernel config choices and the per-fusion choices. The fusion choices
are cached with the kernel choices (same file, same environment key), keyed by the model's shapes,
batch, dtype and the sources of the layers and kernels, so ``vit_fast.optimize(model, tune=True)``
applies what ``vit-fast tune`` measured without timing again. Nothing is timed on CPU or in the
interpreter (the route stays as it is). Under torch.distributed rank 0 times and broadcasts its choices
(kernel configs and fusions) to every rank.
"""
from __future__ import annotations

import contextlib
import dataclasses
import time
from typing import Any, Callable, Optional

import torch
import torch.nn as nn

from .kernels import _tuning
from .route import NONDETERMINISTIC, PART_IMPLS, STATIC_ROUTE, apply_route, route_of

FUSIONS: dict[str, str] = {  # fusion -> its implementations (vit_fast/route.py)
    "patch_embed": "patch_embed kernel | conv + cat + position add",
    "attention": "attention_linear (qkv GEMM + flash attention) | the same with the short-sequence kernels | "
                 "qkv GEMM + SDPA on the packed qkv | qkv GEMM + SDPA as timm",
    "mlp": "linear_act (fc1 GEMM + bias + act epilogue, fc2 GEMM) | fc1 GEMM + bias_gelu kernel + fc2 GEMM | "
           "fc1 GEMM with bias + act + fc2 GEMM",
    "join": "add_layer_norm | bias, LayerScale, dropout, residual adds + F.layer_norm",
}
_LAYER_MODULES = ("vit_fast.layers.norm", "vit_fast.layers.patch_embed", "vit_fast.layers.attention",
                  "vit_fast.layers.mlp", "vit_fast.layers.block", "vit_fast.sdpa", "vit_fast.kernels.attention",
                  "vit_fast.kernels.linear_act", "vit_fast.kernels.layer_norm", "vit_fast.kernels.patch_embed")


def candidates_for(op: str) -> tuple[str, ...]:
    """The implementations of ``op`` that tuning times (the static one first)."""
    deterministic = torch.are_deterministic_algorithms_enabled()
    return tuple(impl for impl in PART_IMPLS[op] if not (deterministic and (op, impl) in NONDETERMINISTIC))


@dataclasses.dataclass(frozen=True)
class FusionRow:
    op: str
    times_ms: Optional[tuple[float, ...]]  # one per candidate; None where nothing was timed
    choice: str  # one of candidates
    candidates: tuple[str, ...] = ("fused", "eager")

    @property
    def speedup(self) -> float:
        """The chosen implementation's speedup over the fastest other one (>= 1 when timed)."""
        if self.times_ms is None or len(self.times_ms) < 2:
            return float("nan")
        chosen = self.times_ms[self.candidates.index(self.choice)]
        return min(t for c, t in zip(self.candidates, self.times_ms) if c != self.choice) / chosen


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


# ------------------------------------------------------------------------------------------ route
def _vit(model: nn.Module) -> nn.Module:
    from .interop.optimize import vit_fast_model_of

    return vit_fast_model_of(model)


def set_fusion_choices(model: nn.Module, choices: dict[str, str | bool], source: str = "set_fusion_choices") -> None:
    """Apply {'attention': 'sdpa', 'mlp': 'fused', ...} (or booleans, True = fused, False = eager) to the
    model's route; fusions not named keep their choice. Unknown names or values raise ValueError."""
    resolved = {}
    for op, choice in choices.items():
        if op not in PART_IMPLS:
            raise ValueError(f"unknown fusion {op!r}; expected one of {sorted(PART_IMPLS)}")
        impl = {True: "fused", False: "eager"}.get(choice, choice) if isinstance(choice, bool) else choice
        if impl not in PART_IMPLS[op]:
            raise ValueError(f"fusion {op!r}: expected one of {list(PART_IMPLS[op])} (or a bool), got {choice!r}")
        resolved[op] = impl
    apply_route(model, route_of(model).with_choices(resolved, source))


def fusion_choices(model: nn.Module) -> dict[str, str]:
    """The current implementation per fusion (the model's route)."""
    return route_of(model).choices()


def set_static_route(model: nn.Module) -> None:
    """Every part fused, on every device (bitwise-reproducible runs across machines)."""
    apply_route(model, STATIC_ROUTE)


# ------------------------------------------------------------------------------------ measuring
def _signature(vit: nn.Module, batch_size: int, dtype: torch.dtype) -> str:
    c = vit.config
    fields = ("img_size", "patch_size", "in_chans", "embed_dim", "num_heads", "mlp_ratio", "qkv_bias", "qk_norm",
              "init_values", "class_token", "reg_tokens", "no_embed_class", "act", "residual_in_fp32", "mlp_layer",
              "distilled", "pre_norm", "proj_drop_rate", "attn_drop_rate", "drop_path_rate")
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
    # the join is timed where drop-path is heaviest (timm's schedule leaves the first block without it)
    join_blk = max(vit.blocks, key=lambda b: getattr(b.drop_path1, "drop_prob", 0.0))
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

    bias = join_blk.attn.join_terms()[0]
    join_params = (params(join_blk.norm2) + params(join_blk.ls1)
                   + ([bias] if bias is not None and bias.requires_grad else []))

    def join():  # the block's first join (attention branch + residual, then norm2), as forward_pair runs it
        return join_blk._join(branch, residual, join_blk.attn, join_blk.ls1, join_blk.drop_path1, join_blk.norm2)

    return {
        "patch_embed": lambda: _fwd_bwd(lambda: vit.embed(images), [], [vit.patch_embed.proj.weight,
                                        vit.patch_embed.proj.bias, vit.pos_embed, vit.cls_token], amp, device),
        "attention": lambda: _fwd_bwd(lambda: blk.attn.branch(x), [x], params(blk.attn), amp, device),
        "mlp": lambda: _fwd_bwd(lambda: blk.mlp.branch(x), [x], params(blk.mlp), amp, device),
        "join": lambda: _fwd_bwd(join, [branch, residual], join_params, amp, device),
    }


def measure_fusions(model: nn.Module, batch_size: int, dtype: torch.dtype,
                    fusions: Optional[list[str]] = None) -> list[FusionRow]:
    """Time every implementation of every fusion (fwd + bwd, the model's shapes) and return one row per
    fusion; the model's route is left as it was. Where nothing may be timed (CPU, interpreter, switch off,
    tracing), each row keeps the model's current choice without times."""
    vit = _vit(model)
    device = vit.patch_embed.proj.weight.device
    names = list(FUSIONS) if fusions is None else fusions
    before, was_explicit = route_of(vit), vit.route_explicit
    if not _tuning.can_time(device):
        return [FusionRow(op, None, before.choices()[op], candidates_for(op)) for op in names]
    rows = []
    # the timed runs draw dropout seeds and masks, as many as the timer repeats them: the caller's generators are
    # left as they were, so a run that measured trains as one that read the cache
    with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []):
        builders = _benchmarks(vit, batch_size, dtype)
        try:
            for op in names:
                candidates = candidates_for(op)
                times = []
                for candidate in candidates:
                    set_fusion_choices(vit, {op: candidate})
                    run = builders[op]()
                    run()  # warm-up outside the timer: compiles and picks the kernels' configs
                    times.append(float(_tuning._state.timer(run, f"fusion:{op}:{candidate}")))
                best = min(range(len(times)), key=lambda i: (times[i], i))  # ties: the earlier (static first)
                rows.append(FusionRow(op, tuple(times), candidates[best], candidates))
        finally:
            apply_route(vit, before, explicit=was_explicit)
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
    if world > 1 and not (torch.distributed.is_available() and torch.distributed.is_initialized()):
        raise ValueError(f"tune_model: WORLD_SIZE is {world} but no process group exists; call it after "
                         f"torch.distributed.init_process_group (rank 0 measures and broadcasts its choices to every "
                         f"rank), or use optimize(model, tune=False) until then")
    if world > 1:
        result, chosen, failure = None, None, None
        if torch.distributed.get_rank() == 0:
            try:
                with _tuning.overridden(local_in_distributed=True, fresh=False):
                    result = _tune_local(vit, device, batch_size, dtype, refresh)
                    # a cached route times nothing: the cached kernel choices go out with this process's own
                    chosen = {**_tuning.cached_decisions(device), **_tuning.decisions()}
            except Exception as e:  # noqa: BLE001  (every rank raises it: none is left waiting in the broadcast)
                failure = f"{type(e).__name__}: {e}"
        payload = [(result, chosen, failure)]
        torch.distributed.broadcast_object_list(payload, src=0)
        result, chosen, failure = payload[0]
        if failure is not None:
            raise RuntimeError(f"tune_model: rank 0 failed while measuring, so no rank tunes: {failure}")
        _tuning.install_decisions(chosen)
    else:
        result = _tune_local(vit, device, batch_size, dtype, refresh)
    if result.timed or result.cached:  # else nothing was decided: the model still follows its device's default
        set_fusion_choices(vit, result.choices, source="vit-fast tune" + (" (cached)" if result.cached else ""))
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
            "source": source, "choice": r.choice, "candidates": list(r.candidates), "times_ms": list(r.times_ms),
            "written": time.time()} for r in rows})
    note = "" if timed else "nothing timed (no CUDA device, the interpreter, or autotuning off): the route as it was"
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
            if not key.startswith(prefix) or e.get("source") != source or e.get("choice") not in candidates_for(op):
                continue
            rest = key[len(prefix):]  # ",dtype=torch.bfloat16,training=True|batch=64"
            if dtype is not None and not rest.startswith(f",dtype={dtype},"):
                continue
            if f",training={vit.training}|" not in rest:
                continue
            if batch_size is not None and not rest.endswith(f"|batch={int(batch_size)}"):
                continue
            written = float(e.get("written", 0.0))
            times, candidates = e.get("times_ms"), tuple(e.get("candidates", ("fused", "eager")))
            timed = isinstance(times, list) and len(times) == len(candidates) and e["choice"] in candidates
            row = FusionRow(op, tuple(times) if timed else None, e["choice"], candidates)
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
        label = f"{times} ({' / '.join(r.candidates)})"
        lines.append(f"{'fusion ' + r.op:<34} {len(r.candidates):<10} {label:<40} {r.choice:<40} {speed}")
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
