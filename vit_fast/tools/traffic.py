"""`vit-fast traffic`: bytes moved and kernel launches of one training step, with a roofline (CONTRIBUTING.md 3c).

One step is forward + cross-entropy + backward, no optimizer. It is counted on CPU:
  - aten ops with a TorchDispatchMode: every non-view aten op is one launch, reading the bytes of its
    tensor inputs and writing the bytes of its tensor outputs (memory span of each tensor, so an
    expanded stride-0 tensor counts once); FLOPs from torch.utils.flop_counter's formulas;
  - Triton kernels by instrumenting the Triton interpreter (TRITON_INTERPRET=1): each launch, the bytes
    of every load and store over unmasked lanes ("requested") and over distinct addresses ("unique",
    a DRAM model where re-reads within one launch hit L2, as the aten side assumes), and 2*M*N*K per
    tl.dot. The interpreter's own argument copies are not counted.
The eager paths are timm's VisionTransformer (random weights) under torch.autocast, with timm's fused
SDPA attention and with ``fused_attn=False``; the fused path is vit_fast's model with backend='triton',
as built (residual stream in fp32 under autocast, as timm) and with ``residual_in_fp32=False``.

Counting runs at two small batches; every op is fitted as ``fixed + per_image * batch`` (weights and
their gradients are the fixed part, activations the per-image part) and evaluated at the requested
batch. The interpreter is slow, so models are
also counted at depth 1 and 2 only: all blocks run the
same ops on the same shapes, so every sum is affine in depth and is evaluated at the preset's depth
(tests check both extrapolations against direct counts). The roofline lower bound of an op is
max(FLOPs / peak, bytes / bandwidth) with the guide's
measured H100 and A100 figures; the step time is the sum over ops, launch overhead excluded.

timm under torch.compile is counted by lowering inductor's code for a fake H100 (vit_fast.tools.inductor_count),
directly at the batch and full depth. ``--predict`` turns the counts into a PREDICTED step time per path on
H100 and A100 with SASS ceilings and library efficiencies (vit_fast.tools.predict), and with a GPU at hand
times the paths and prints measured beside predicted per op family.
"""
from __future__ import annotations

import argparse
import contextlib
import dataclasses
import os
import subprocess
import sys
import time
from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from vit_fast.tools import POSITIVE_INT, preset_name

# CONTRIBUTING.md 5: measured H100 figures, A100 datasheet figures. fp32 GEMMs run as TF32 at half the rate.
ROOFLINE = {
    "H100": dict(tflops=790.0, tb_per_s=3.0),
    "A100": dict(tflops=312.0, tb_per_s=2.0),
}
FAMILIES = ("GEMM", "attention", "norm", "elementwise", "embed", "other")

_GEMM = {"mm", "addmm", "_scaled_mm", "linear"}
# bmm only appears in ViT as the two attention products of the unfused path (q @ k^T, attn @ v).
_ATTENTION = {"bmm", "baddbmm", "_softmax", "_softmax_backward_data", "softmax"}
_NORM = {"native_layer_norm", "native_layer_norm_backward", "layer_norm"}
_EMBED = {"convolution", "convolution_backward", "_convolution", "cat"}  # cat: the class token joins the patches
_OTHER = {"_log_softmax", "_log_softmax_backward_data", "nll_loss_forward", "nll_loss_backward", "nll_loss2d_forward"}
# aten ops that launch no kernel on a GPU (allocation, metadata, host-side scalars).
_NO_KERNEL = {"empty", "empty_like", "empty_strided", "detach", "lift_fresh", "lift_fresh_copy", "alias",
              "_local_scalar_dense", "is_same_size", "_has_compatible_shallow_copy_type", "set_", "new_empty",
              "new_empty_strided", "_unsafe_view", "promote_types", "result_type"}
_TRITON_FAMILIES = {"layer_norm": "norm", "attention": "attention", "bias_gelu": "elementwise", "patch_embed": "embed",
                    "linear_act": "GEMM", "swiglu": "elementwise",
                    "sum_partials": "elementwise"}  # the fixed-order parameter-gradient sums (kernels/_rows.py)
# GEMM kernels whose tile rows run over batch x tokens: at the small count batches their last row tile is mostly
# padding (wrapped rows) that a batch of 256 does not have (at most one tile in 50k rows), so counting tl.dot's
# tile FLOPs would not extrapolate in the batch; they count 2*M*N*K from their M, N, K arguments instead. Attention
# tiles run over one image's tokens: their padding is per image, real on a GPU, and counted.
# (patch_embed's three GEMMs have the same padding; they are 0.3% of the step's FLOPs and are counted by tile.)
_GEMM_FLOPS_FROM_ARGS = ("_linear_act_fwd_kernel", "_linear_act_bwd_kernel")


@dataclass
class Op:
    name: str
    family: str
    launches: int = 1
    bytes_read: float = 0.0  # unique bytes (aten: tensor spans; Triton: distinct addresses per launch)
    bytes_written: float = 0.0
    flops: float = 0.0
    requested: float = 0.0  # Triton only: bytes over unmasked lanes, re-reads included (aten: = read + written)
    triton: bool = False
    seconds: float = 0.0  # Triton only: time the interpreter took (diagnostics)

    @property
    def bytes(self) -> float:
        return self.bytes_read + self.bytes_written

    def roofline_s(self, gpu: str, dtype: torch.dtype) -> float:
        peak = ROOFLINE[gpu]["tflops"] * 1e12 * (0.5 if dtype == torch.float32 else 1.0)
        return max(self.flops / peak, self.bytes / (ROOFLINE[gpu]["tb_per_s"] * 1e12))


def aten_family(name: str) -> str:
    if name in _GEMM:
        return "GEMM"
    if name in _ATTENTION or "attention" in name:
        return "attention"
    if name in _NORM:
        return "norm"
    if name in _EMBED:
        return "embed"
    if name in _OTHER:
        return "other"
    return "elementwise"


def triton_family(module: str, name: str) -> str:
    for key, family in _TRITON_FAMILIES.items():
        if key in module.rsplit(".", 1)[-1] or key in name:
            return family
    return "other"


def tensor_bytes(t: torch.Tensor) -> int:
    """Bytes of memory a tensor covers: its span, so expanded (stride-0) dims count once."""
    if t.numel() == 0:
        return 0
    span = 1 + sum((s - 1) * abs(st) for s, st in zip(t.shape, t.stride()))
    return min(span, t.numel()) * t.element_size()


def _unique_bytes(tensors) -> int:
    seen, total = set(), 0
    for t in tensors:
        if not isinstance(t, torch.Tensor) or t.device.type == "meta":
            continue
        key = (t.data_ptr(), tuple(t.shape), t.stride(), t.dtype)
        if key not in seen:
            seen.add(key)
            total += tensor_bytes(t)
    return total


def _attention_flops(name: str, args) -> float:
    """Forward 4*B*H*Nq*Nk*d; backward 10*B*H*Nq*Nk*d (four products plus the FA2 score recompute)."""
    q, k = args[0], args[1]
    if not isinstance(q, torch.Tensor) or q.dim() != 4:
        return 0.0
    if "backward" in name:  # args: grad_out, q, k, v, ...
        q, k = args[1], args[2]
        return 10.0 * q.shape[0] * q.shape[1] * q.shape[2] * k.shape[2] * q.shape[3]
    return 4.0 * q.shape[0] * q.shape[1] * q.shape[2] * k.shape[2] * q.shape[3]


class StepCounter(TorchDispatchMode):
    """Records every aten op and (with instrument_triton) every interpreted Triton launch as an Op."""

    def __init__(self, instrument_triton: bool = True, memo: dict | None = None):
        super().__init__()
        self.ops: list[Op] = []
        self.instrument_triton = instrument_triton
        # Launch key -> counted Op. A launch identical to one already counted (same kernel, grid,
        # scalars and tensor layouts) is replayed, not interpreted: its loads, stores and dots are
        # fixed by those alone. Its outputs stay unwritten, which no later count depends on.
        self.memo = memo
        self.replayed = 0
        self._in_triton = 0
        self._launch: Op | None = None
        self._addresses: dict[str, list] = {}
        self._patches: list = []

    # -- aten ---------------------------------------------------------------------------------
    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if self._in_triton:  # the interpreter copying kernel arguments to and from the host
            return func(*args, **kwargs)
        impl = self._vit_fast_custom_op(func)
        if impl is not None:  # run the launcher's body under this mode so its aten ops are seen too
            with self:
                return impl(*args, **kwargs)
        out = func(*args, **kwargs)
        name = func.overloadpacket.__name__
        if func.is_view or name in _NO_KERNEL:
            return out
        from torch.utils.flop_counter import flop_registry

        family = aten_family(name)
        if func.overloadpacket in flop_registry:
            flops = float(flop_registry[func.overloadpacket](*args, **kwargs, out_val=out))
        elif family == "attention" and "attention" in name:
            flops = _attention_flops(name, args)
        else:
            flops = 0.0
        read = _unique_bytes(tree_leaves((args, kwargs)))
        written = _unique_bytes(tree_leaves(out))
        self.ops.append(Op(name, family, 1, read, written, flops, read + written))
        return out

    @staticmethod
    def _vit_fast_custom_op(func):
        from vit_fast.kernels._utils import kernel_op_of

        op = kernel_op_of(func)
        return None if op is None else op.function

    # -- Triton interpreter --------------------------------------------------------------------
    def __enter__(self):
        # Re-entered around custom-op bodies (the mode is off inside __torch_dispatch__): patch once.
        self._depth = getattr(self, "_depth", 0) + 1
        if self._depth == 1 and self.instrument_triton:
            self._patch_interpreter()
        return super().__enter__()

    def __exit__(self, *exc):
        self._depth -= 1
        if self._depth == 0:
            for patch in reversed(self._patches):
                patch() if callable(patch) else setattr(*patch)  # a callable undoes a _compat wrapping
            self._patches.clear()
        return super().__exit__(*exc)

    def _patch(self, obj, attr, new):
        self._patches.append((obj, attr, getattr(obj, attr)))
        setattr(obj, attr, new)

    def _patch_interpreter(self):
        from triton.runtime import interpreter as interp

        counter = self
        load, store, dot = (interp.InterpreterBuilder.create_masked_load,
                            interp.InterpreterBuilder.create_masked_store, interp.InterpreterBuilder.create_dot)

        def counted_run(fn_self, run, *args, grid, warmup, **kwargs):
            if warmup or counter._launch is not None:
                return run(*args, grid=grid, warmup=warmup, **kwargs)
            fn = fn_self.fn
            key = _launch_key(fn_self, args, kwargs, grid) if counter.memo is not None else None
            if key is not None and key in counter.memo:
                counter.ops.append(dataclasses.replace(counter.memo[key], seconds=0.0))
                counter.replayed += 1
                return None
            counter._launch = Op(fn.__name__, triton_family(fn.__module__, fn.__name__), triton=True)
            counter._addresses = {"r": [], "w": []}
            counter._in_triton += 1
            start = time.perf_counter()
            try:
                return run(*args, grid=grid, warmup=warmup, **kwargs)
            finally:
                counter._in_triton -= 1
                op, counter._launch = counter._launch, None
                op.seconds = time.perf_counter() - start
                op.bytes_read = _distinct_bytes(counter._addresses["r"])
                op.bytes_written = _distinct_bytes(counter._addresses["w"])
                if fn.__name__ in _GEMM_FLOPS_FROM_ARGS:
                    named = {**dict(zip(fn_self.arg_names, args)), **kwargs}
                    op.flops = 2.0 * float(named["M"]) * float(named["N"]) * float(named["K"])
                counter.ops.append(op)
                if key is not None:
                    counter.memo[key] = op

        def note(kind, ptrs, mask):
            op = counter._launch
            if op is None:
                return
            size = ptrs.get_element_ty().primitive_bitwidth // 8
            addresses = ptrs.data if mask is None else ptrs.data[np.broadcast_to(mask.data, ptrs.data.shape)]
            op.requested += addresses.size * size
            counter._addresses[kind].append((addresses.ravel().copy(), size))

        def counted_load(b, ptrs, mask, *rest):
            note("r", ptrs, mask)
            return load(b, ptrs, mask, *rest)

        def counted_store(b, ptrs, value, mask, *rest):
            note("w", ptrs, mask)
            return store(b, ptrs, value, mask, *rest)

        def counted_dot(b, a, bb, d, *rest):
            if counter._launch is not None:
                counter._launch.flops += 2.0 * a.data.size * bb.data.shape[-1]
            return dot(b, a, bb, d, *rest)

        from vit_fast._compat import wrap_interpreted_run

        self._patches.append(wrap_interpreted_run(counted_run))  # InterpretedFunction.run differs across triton
        self._patch(interp.InterpreterBuilder, "create_masked_load", counted_load)
        self._patch(interp.InterpreterBuilder, "create_masked_store", counted_store)
        # Patch the currently installed create_dot (tests may have wrapped it with the bf16 shim).
        self._patch(interp.InterpreterBuilder, "create_dot", counted_dot)


def _launch_key(fn_self, args, kwargs, grid):
    """Everything a launch's addresses depend on; None when an argument is not understood."""
    storages: list[int] = []
    parts = []
    for name, value in list(zip(fn_self.arg_names, args)) + sorted(kwargs.items()):
        if isinstance(value, torch.Tensor):
            ptr = value.untyped_storage().data_ptr()
            if ptr not in storages:
                storages.append(ptr)
            parts.append((name, tuple(value.shape), value.stride(), str(value.dtype), value.storage_offset(),
                          storages.index(ptr)))
        elif value is None or isinstance(value, (bool, int, float, str)):
            parts.append((name, value))
        elif type(value).__module__.startswith("triton"):
            parts.append((name, repr(value)))
        else:
            return None
    if callable(grid):
        grid = grid({**dict(zip(fn_self.arg_names, args)), **kwargs})
    return (fn_self.fn, tuple(grid), tuple(parts))


def _distinct_bytes(chunks) -> float:
    by_size: dict[int, list] = {}
    for addresses, size in chunks:
        by_size.setdefault(size, []).append(addresses)
    return float(sum(np.unique(np.concatenate(a)).size * size for size, a in by_size.items()))


# ----------------------------------------------------------------------------------------------
# Models and one counted step

PATHS = ("timm_eager", "timm_eager_unfused_attn", "timm_compile", "vit_fast", "vit_fast_bf16_residual")
PATH_LABELS = {
    "timm_eager": "timm eager (SDPA attention)",
    "timm_compile": "timm torch.compile (inductor, default mode)",
    "timm_eager_unfused_attn": "timm eager, fused_attn=False",
    "vit_fast": "vit_fast backend='triton'",
    "vit_fast_bf16_residual": "vit_fast, residual_in_fp32=False",
}


def build_model(path: str, preset: str, **overrides) -> torch.nn.Module:
    torch.manual_seed(0)
    if path.startswith("timm"):
        import timm

        model = timm.create_model(preset, pretrained=False, **overrides)
        if path == "timm_eager_unfused_attn":
            for m in model.modules():
                if hasattr(m, "fused_attn"):
                    m.fused_attn = False
        return model.train()
    import vit_fast

    if path == "vit_fast_bf16_residual":
        overrides = dict(overrides, residual_in_fp32=False)
    return vit_fast.create_model(preset, backend="triton", **overrides).train()


def count_step(model: torch.nn.Module, batch: int, dtype: torch.dtype = torch.bfloat16, img_size: int = 224,
               in_chans: int = 3, num_classes: int = 1000, memo: dict | None = None) -> list[Op]:
    """Ops of one forward + cross-entropy + backward at `batch`, under autocast to `dtype` (none for fp32)."""
    gen = torch.Generator().manual_seed(batch)
    x = torch.randn(batch, in_chans, img_size, img_size, generator=gen)
    y = torch.randint(0, max(num_classes, 1), (batch,), generator=gen)
    model.zero_grad(set_to_none=True)
    autocast = torch.autocast("cpu", dtype=dtype) if dtype != torch.float32 else contextlib.nullcontext()
    with StepCounter(memo=memo) as counter:
        with autocast:
            out = model(x)
        loss = F.cross_entropy(out.float(), y) if num_classes else out.float().square().mean()
        loss.backward()
    return counter.ops


def scale_ops(small: list[Op], large: list[Op], b_small: int, b_large: int, batch: int) -> list[Op]:
    """Per-op affine extrapolation from two counted batches to `batch` (fixed + per_image * batch)."""
    if len(small) != len(large) or any(a.name != b.name for a, b in zip(small, large)):
        raise RuntimeError(f"the op sequence differs between batch {b_small} and {b_large}; cannot scale per op")

    def fit(a, b):
        return max(a + (b - a) * (batch - b_small) / (b_large - b_small), 0.0)

    return [Op(b.name, b.family, b.launches, fit(a.bytes_read, b.bytes_read), fit(a.bytes_written, b.bytes_written),
               fit(a.flops, b.flops), fit(a.requested, b.requested), b.triton) for a, b in zip(small, large)]


COUNT_KEYS = ("launches", "read", "written", "requested", "flops")
TOTAL_KEYS = COUNT_KEYS + tuple(ROOFLINE)


def aggregate(ops: list[Op], dtype: torch.dtype) -> dict[tuple, dict]:
    """Sum per (family, op name, is-Triton): launches, bytes, FLOPs, and roofline seconds per GPU
    (computed per op, then summed: ops run one after another)."""
    groups: dict[tuple, dict] = {}
    for o in ops:
        g = groups.setdefault((o.family, o.name, o.triton), dict.fromkeys(TOTAL_KEYS, 0.0))
        g["launches"] += o.launches
        g["read"] += o.bytes_read
        g["written"] += o.bytes_written
        g["requested"] += o.requested
        g["flops"] += o.flops
        for gpu in ROOFLINE:
            g[gpu] += o.roofline_s(gpu, dtype)
    return groups


def extrapolate_depth(shallow: dict, deep: dict, d_shallow: int, d_deep: int, depth: int) -> dict:
    """Every block of a ViT is the same ops on the same shapes, so each group's sum is affine in depth."""
    out = {}
    for key in set(shallow) | set(deep):
        a = shallow.get(key, dict.fromkeys(TOTAL_KEYS, 0.0))
        b = deep.get(key, dict.fromkeys(TOTAL_KEYS, 0.0))
        out[key] = {k: max(a[k] + (b[k] - a[k]) * (depth - d_shallow) / (d_deep - d_shallow), 0.0) for k in TOTAL_KEYS}
    return out


def depth_slope(shallow: dict, deep: dict, d_shallow: int, d_deep: int) -> dict:
    """What one more block adds to each group: one whole block, whatever the last block does
    differently (under class-token pooling it runs on token 0 only, at every depth)."""
    zero = dict.fromkeys(TOTAL_KEYS, 0.0)
    return {key: {k: (deep.get(key, zero)[k] - shallow.get(key, zero)[k]) / (d_deep - d_shallow) for k in TOTAL_KEYS}
            for key in set(shallow) | set(deep)}


def _sum(groups) -> dict:
    total = dict.fromkeys(TOTAL_KEYS, 0.0)
    for g in groups:
        for k in TOTAL_KEYS:
            total[k] += g[k]
    return total


@dataclass
class PathResult:
    path: str
    groups: dict  # (family, op name, triton) -> totals, at `batch` and the model's full depth
    batch: int
    how: str = ""
    count_seconds: float = 0.0
    block_groups: dict | None = None  # one block at `batch`: the depth slope (counted at two depths)
    activation_bytes: int = 0  # one token sequence N x D in bf16 per image: the unit of the block figures

    def totals(self) -> dict:
        return _sum(self.groups.values())

    def by_family(self) -> dict[str, dict]:
        return {fam: _sum(g for (f, _, _), g in self.groups.items() if f == fam)
                for fam in FAMILIES if any(f == fam for f, _, _ in self.groups)}

    def triton_totals(self) -> dict:
        return _sum(g for (_, _, triton), g in self.groups.items() if triton)

    def groups_json(self) -> list[dict]:
        """The counted op groups as JSON rows (what a stored count keeps: vit_fast/data/counts)."""
        return [dict(family=f, name=n, triton=t, **{k: g[k] for k in COUNT_KEYS})
                for (f, n, t), g in sorted(self.groups.items())]

    @classmethod
    def from_json(cls, path: str, doc: dict, dtype: torch.dtype = torch.bfloat16) -> "PathResult":
        """A path stored by `vit-fast traffic --json` (its "groups" rows); the per-GPU rooflines are recomputed
        from one average launch per group, so GPUs added to ROOFLINE later get theirs."""
        groups = {}
        for row in doc["groups"]:
            g = {k: float(row[k]) for k in COUNT_KEYS}
            n = max(g["launches"], 1.0)
            op = Op(row["name"], row["family"], 1, g["read"] / n, g["written"] / n, g["flops"] / n,
                    triton=row["triton"])
            groups[(row["family"], row["name"], bool(row["triton"]))] = {
                **g, **{gpu: n * op.roofline_s(gpu, dtype) for gpu in ROOFLINE}}
        return cls(path, groups, int(doc["batch"]), doc.get("how", ""))

    def block_by_family(self) -> dict[str, float]:
        """Bytes one block moves per image, by family (every family, 0 where a path has none), and 'total'."""
        if not self.block_groups:
            return {}
        out = {fam: _sum(g for (f, _, _), g in self.block_groups.items() if f == fam) for fam in FAMILIES}
        out = {fam: (t["read"] + t["written"]) / self.batch for fam, t in out.items()}
        return {**out, "total": sum(out.values())}


def measure(path: str, preset: str, batch: int, dtype: torch.dtype = torch.bfloat16, count_batches=(2, 3),
            count_depths=(1, 2), replay: bool | dict = True, **overrides) -> PathResult:
    """Count `path` for `preset` at the small batches and depths, scaled to `batch` and the full depth.

    With count_depths=None the model is counted at its full depth; with one count batch equal to
    `batch` nothing is scaled in batch. With `replay`, identical Triton launches are interpreted once
    (see StepCounter), which makes the depth-2 count of the fused model nearly free; a dict passed as
    `replay` holds the counted launches across calls (another path launching the same kernels).
    """
    from vit_fast.presets import get_config

    if path == "timm_compile":
        return measure_compiled(preset, batch, dtype, **overrides)
    cfg = get_config(preset, **overrides)
    kw = dict(dtype=dtype, img_size=cfg.img_size[0], in_chans=cfg.in_chans, num_classes=cfg.num_classes,
              memo=replay if isinstance(replay, dict) else {} if replay else None)
    depths = tuple(count_depths) if count_depths and cfg.depth > max(count_depths) else (cfg.depth,)
    batches = (batch,) if batch in count_batches else tuple(count_batches)
    t0 = time.perf_counter()
    per_depth = []
    for depth in depths:
        model = build_model(path, preset, **{**overrides, "depth": depth})
        counted = [count_step(model, b, **kw) for b in batches]
        ops = counted[0] if len(batches) == 1 else scale_ops(*counted, *batches, batch)
        per_depth.append(aggregate(ops, dtype))
    groups = per_depth[0] if len(depths) == 1 else extrapolate_depth(*per_depth, *depths, cfg.depth)
    block = depth_slope(*per_depth, *depths) if len(depths) > 1 else None
    how = f"counted at batch {' and '.join(map(str, batches))}"
    if len(batches) > 1:
        how += f", extrapolated per op to batch {batch} as fixed + per_image * batch"
    if len(depths) > 1:
        how += (f"; counted at depth {depths[0]} and {depths[1]}, extrapolated to depth {cfg.depth} "
                "(blocks are identical)")
    return PathResult(path, groups, batch, how, time.perf_counter() - t0, block, cfg.num_tokens * cfg.embed_dim * 2)


def measure_compiled(preset: str, batch: int, dtype: torch.dtype = torch.bfloat16, mode: str = "default",
                     **overrides) -> PathResult:
    """timm's step as torch.compile lowers it for an H100 (vit_fast.tools.inductor_count): counted directly at
    `batch` and the full depth (nothing runs, so the batch costs nothing), one launch per generated kernel or
    library call. Raises inductor_count.InductorCountUnavailable where the installed torch lowers differently."""
    from vit_fast.presets import get_config
    from vit_fast.tools import inductor_count

    cfg = get_config(preset, **overrides)
    t0 = time.perf_counter()
    model = build_model("timm_eager", preset, **overrides)
    records = inductor_count.count_compiled_step(model, batch, dtype, cfg.img_size[0], cfg.in_chans, cfg.num_classes,
                                                 mode=mode)
    groups = aggregate(inductor_count.to_ops(records), dtype)
    return PathResult("timm_compile", groups, batch, f"lowered by inductor ({mode}) for a fake H100 at batch {batch}, "
                      "full depth; generated kernels counted, nothing run", time.perf_counter() - t0,
                      None, cfg.num_tokens * cfg.embed_dim * 2)


# ----------------------------------------------------------------------------------------------
# Output


def _row(cells, widths):
    return "  ".join(str(c).rjust(w) if i else str(c).ljust(w) for i, (c, w) in enumerate(zip(cells, widths)))


def format_path(r: PathResult) -> str:
    head = ("family", "launches", "read GB", "written GB", "GFLOP", "H100 ms", "A100 ms")
    widths = (12, 8, 9, 10, 9, 8, 8)
    lines = [f"{PATH_LABELS.get(r.path, r.path)}: {r.how} (counting took {r.count_seconds:.0f} s)", _row(head, widths)]
    for fam, t in list(r.by_family().items()) + [("total", r.totals())]:
        lines.append(_row((fam, round(t["launches"]), f"{t['read'] / 1e9:.3f}", f"{t['written'] / 1e9:.3f}",
                           f"{t['flops'] / 1e9:.0f}", f"{t['H100'] * 1e3:.2f}", f"{t['A100'] * 1e3:.2f}"), widths))
    block = r.block_by_family()
    if block:
        unit = r.activation_bytes
        parts = ", ".join(f"{fam} {b / 1e6:.2f}" for fam, b in block.items() if fam != "total" and b)
        lines.append(f"one block (depth slope), per image: {block['total'] / 1e6:.2f} MB = "
                     f"{block['total'] / unit:.1f} x (N x D bf16 activation); MB by family: {parts}")
    tt = r.triton_totals()
    if tt["launches"]:
        req, uniq = tt["requested"] / 1e9, (tt["read"] + tt["written"]) / 1e9
        lines.append(f"Triton kernels: {uniq:.3f} GB distinct addresses per launch, "
                     f"{req:.3f} GB requested by unmasked lanes (re-reads included)")
    return "\n".join(lines)


def format_top_ops(r: PathResult, n: int = 15) -> str:
    """The op groups moving the most bytes: where the step's traffic goes."""
    rows = sorted(r.groups.items(), key=lambda kv: -(kv[1]["read"] + kv[1]["written"]))[:n]
    total = max(r.totals()["read"] + r.totals()["written"], 1.0)
    lines = [f"top {len(rows)} ops of {PATH_LABELS.get(r.path, r.path)} by bytes:"]
    for (fam, name, triton), g in rows:
        moved = g["read"] + g["written"]
        lines.append(f"  {name:40s} {fam:11s} {'triton' if triton else 'aten':6s} {round(g['launches']):5d} launches "
                     f"{moved / 1e9:8.3f} GB ({moved / total:5.1%})  H100 {g['H100'] * 1e3:.2f} ms")
    return "\n".join(lines)


def format_summary(results: list[PathResult]) -> str:
    base, base_block = results[0].totals(), results[0].block_by_family().get("total")
    head = ("path", "launches", "GB moved", "H100 ms", "H100 img/s", "A100 ms", "A100 img/s", "bytes/eager",
            "launches/eager", "block/eager")
    widths = (32, 8, 9, 8, 10, 8, 10, 11, 14, 11)
    lines = [_row(head, widths)]
    for r in results:
        t, block = r.totals(), r.block_by_family().get("total")
        moved, base_moved = t["read"] + t["written"], base["read"] + base["written"]
        lines.append(_row((PATH_LABELS.get(r.path, r.path), round(t["launches"]), f"{moved / 1e9:.2f}",
                           f"{t['H100'] * 1e3:.1f}", f"{r.batch / t['H100']:.0f}", f"{t['A100'] * 1e3:.1f}",
                           f"{r.batch / t['A100']:.0f}", f"{moved / base_moved:.2f}",
                           f"{t['launches'] / base['launches']:.2f}",
                           f"{block / base_block:.2f}" if block and base_block else "-"), widths))
    return "\n".join(lines)


def fused_model_available() -> tuple[bool, str]:
    """The fused path is counted on CPU in the Triton interpreter, which must be on before kernels are defined."""
    from vit_fast.kernels._utils import interpreter_active

    if not interpreter_active():
        return False, ("the fused path is counted in the Triton interpreter; "
                       "set TRITON_INTERPRET=1 before triton is imported")
    return True, ""


def build_parser(parser: argparse.ArgumentParser | None = None) -> argparse.ArgumentParser:
    parser = parser or argparse.ArgumentParser(prog="vit-fast traffic", description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", nargs="+", default=["vit_base_patch16_224"], metavar="PRESET", type=preset_name,
                        help="preset name(s); each is counted in turn")
    parser.add_argument("--batch", type=POSITIVE_INT, default=256, help="batch the counts are scaled to")
    parser.add_argument("--dtype", default="bf16", choices=("bf16", "fp16", "fp32"))
    parser.add_argument("--count-batches", type=int, nargs=2, default=(2, 3), metavar=("B1", "B2"),
                        help="the two small batches actually counted "
                             "(default 2 3; at batch 1 autograd skips some reductions)")
    parser.add_argument("--count-depths", type=int, nargs=2, default=(1, 2), metavar=("D1", "D2"),
                        help="the two depths actually counted (default 1 2); 0 0 counts the full depth")
    parser.add_argument("--paths", nargs="+", default=None, choices=list(PATHS),
                        help="default: every path; with --predict the four the prediction compares")
    parser.add_argument("--top", type=int, default=0, metavar="N",
                        help="also list the N op groups moving the most bytes")
    parser.add_argument("--predict", action="store_true",
                        help="also print the PREDICTED step time, images/s and MFU per model and path on H100 and "
                             "A100 (vit_fast.tools.predict), the time per op family and issue 25's targets")
    parser.add_argument("--measure", choices=("auto", "on", "off"), default="auto",
                        help="with --predict: also time the paths on the CUDA GPU and print predicted beside "
                             "measured per op family (auto: when a GPU is present; on: say why not when none is)")
    parser.add_argument("--json", help="write per-path totals and per-family figures to this path")
    parser.add_argument("--store-counts", metavar="FOLDER",
                        help="write each model's counted op groups to FOLDER/<preset>.json, the form the calibrated "
                             "model ships in vit_fast/data/counts (vit_fast.tools.calibration)")
    parser.add_argument("--stored", action="store_true",
                        help="with --predict: take the counts shipped in vit_fast/data/counts instead of counting "
                             "(seconds instead of minutes; they name the revision they were counted at)")
    return parser


def main(argv=None, args: argparse.Namespace | None = None) -> int:
    args = args or build_parser().parse_args(argv)
    if args.paths is None:
        from vit_fast.tools.predict import PREDICT_PATHS

        args.paths = list(PREDICT_PATHS) if args.predict else list(PATHS)
    models = [args.model] if isinstance(args.model, str) else list(args.model)
    fused_paths = [] if args.stored else [p for p in args.paths if p.startswith("vit_fast")]
    from vit_fast.kernels._utils import interpreter_active

    if fused_paths and not interpreter_active():
        # The fused path is counted in the interpreter, which must be on before any kernel is defined.
        if "triton" in sys.modules:
            argv = sys.argv[1:] if argv is None else list(argv)
            env = dict(os.environ, TRITON_INTERPRET="1")
            return subprocess.run([sys.executable, "-m", "vit_fast.tools.traffic", *argv], env=env).returncode
        os.environ["TRITON_INTERPRET"] = "1"
    if fused_paths:
        from vit_fast.tools.interpreter import install_numpy_fix

        install_numpy_fix()  # triton <= 3.6's interpreter with numpy >= 2.4
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}[args.dtype]
    print(f"vit-fast traffic: {', '.join(models)}, {args.dtype}, batch {args.batch}: one training step "
          f"(forward + cross-entropy + backward, no optimizer), counted on CPU, not timed. "
          f"Roofline = sum over ops of max(FLOPs/peak, bytes/bandwidth); "
          f"H100 {ROOFLINE['H100']['tflops']:.0f} TFLOP/s, "
          f"{ROOFLINE['H100']['tb_per_s']} TB/s; A100 {ROOFLINE['A100']['tflops']:.0f} TFLOP/s, "
          f"{ROOFLINE['A100']['tb_per_s']} TB/s; "
          "launch overhead excluded. Eager: one launch per non-view aten op.\n")
    by_model: dict[str, list[PathResult]] = {}
    if args.stored:
        from vit_fast.tools.calibration import stored_counts

        for model in models:
            stored = stored_counts(model)
            by_model[model] = [stored[p] for p in args.paths if p in stored]
            if not by_model[model]:
                from vit_fast.tools.calibration import stored_presets

                raise SystemExit(f"vit-fast traffic --stored: no stored counts for {model} ({', '.join(args.paths)});"
                                 f" stored: {', '.join(stored_presets())}. Count it without --stored")
            if stored[next(iter(stored))].batch != args.batch:
                raise SystemExit(f"vit-fast traffic --stored: {model}'s stored counts are at batch "
                                 f"{stored[next(iter(stored))].batch}, not {args.batch}; count it without --stored")
            for path in [p for p in args.paths if p not in stored]:
                print(f"{model}: {PATH_LABELS[path]}: left out: no stored counts for this path (stored: "
                      f"{', '.join(stored)}); count it without --stored\n")
            for r in by_model[model]:
                print(f"{model}: " + format_path(r) + "\n", flush=True)
    for model in [] if args.stored else models:
        results = by_model.setdefault(model, [])
        counted = {}  # the fused paths share most launches: each is interpreted once
        for path in args.paths:
            if path in fused_paths:
                ok, why = fused_model_available()
                if not ok:
                    print(f"{PATH_LABELS[path]}: not counted: {why}\n")
                    continue
            try:
                r = measure(path, model, args.batch, dtype, tuple(args.count_batches),
                            tuple(args.count_depths) if all(args.count_depths) else None, replay=counted)
            except RuntimeError as e:
                from vit_fast.tools.inductor_count import InductorCountUnavailable

                if not isinstance(e, InductorCountUnavailable):
                    raise
                print(f"{model}: {PATH_LABELS[path]}: not counted: {e}\n")
                continue
            results.append(r)
            print(f"{model}: " + format_path(r) + "\n", flush=True)
            if args.top:
                print(format_top_ops(r, args.top) + "\n", flush=True)
        if results:
            print(f"{model}:\n" + format_summary(results) + "\n", flush=True)
    predicted = report_predicted(by_model, dtype, args) if args.predict else {}
    if args.json:
        import json

        def path_json(model, r):
            return dict(how=r.how, batch=r.batch, totals=r.totals(), families=r.by_family(),
                        block_bytes_per_image=r.block_by_family(), predicted=predicted.get(model, {}).get(r.path, {}),
                        groups=r.groups_json())

        per_model = {m: dict(paths={r.path: path_json(m, r) for r in rs}) for m, rs in by_model.items()}
        doc = dict(model=models[0], **per_model[models[0]]) if len(models) == 1 else dict(models=per_model)
        with open(args.json, "w") as f:
            json.dump(dict(dtype=args.dtype, batch=args.batch, roofline=ROOFLINE, **doc), f, indent=1)
    if args.store_counts:
        store_counts(by_model, args.store_counts, args.dtype, args.batch)
    return 0


def store_counts(by_model: dict[str, list[PathResult]], folder: str, dtype_name: str, batch: int) -> None:
    """One JSON file per model: its paths' op groups and where and when they were counted."""
    import json
    import platform

    from vit_fast.tools.bench import git_revision

    os.makedirs(folder, exist_ok=True)
    revision = git_revision()
    versions = f"torch {torch.__version__}, python {platform.python_version()}"
    for model, results in by_model.items():
        doc = dict(model=model, dtype=dtype_name, batch=batch, revision=revision, versions=versions,
                   date=time.strftime("%Y-%m-%d"),
                   paths={r.path: dict(how=r.how, groups=r.groups_json()) for r in results})
        with open(os.path.join(folder, f"{model}.json"), "w") as f:
            json.dump(doc, f, indent=0)


def report_predicted(by_model: dict[str, list[PathResult]], dtype: torch.dtype, args) -> dict:
    """--predict: the PREDICTED table over models and paths, per-family time, issue 25's verdict for ViT-B/16,
    and (with a GPU) measured beside predicted. Returns {model: {path: {gpu: predicted step}}} for --json."""
    from vit_fast.tools import predict

    dtype_name = {torch.bfloat16: "bf16", torch.float16: "fp16"}.get(dtype)
    by_model = {m: rs for m, rs in by_model.items() if rs}
    # the SASS ceilings, live from `vit-fast report` (compiled once, cached), where a path has Triton tensor-core work
    needs = [m for m, rs in by_model.items()
             if any(g["flops"] for r in rs for (_, _, tri), g in r.groups.items() if tri)]
    ceilings = {m: {gpu: predict.ceilings_from_report(arch, dtype_name, (m,)) for gpu, arch in predict.GPU_ARCH.items()}
                for m in needs} if dtype_name else {}
    print(predict.format_predicted(by_model, dtype, ceilings) + "\n")
    out: dict = {}
    for model, results in by_model.items():
        c = ceilings.get(model, {})
        for r in results:
            out.setdefault(model, {})[r.path] = {gpu: predict.predicted_step(r, gpu, dtype, c.get(gpu),
                                                                             flops=predict.model_flops(model, r.batch))
                                                 for gpu in predict.GPU_ARCH}
        paths = {r.path: r for r in results}
        if all(p in paths for p in ("timm_eager", "timm_compile", "vit_fast")):
            for r in results:
                print(predict.format_families(r, dtype, c) + "\n")
            print(predict.verdict(paths, dtype, c) + "\n", flush=True)
        if args.measure == "on" or (args.measure == "auto" and torch.cuda.is_available()):
            measured = predict.measure_paths(model, args.batch, args.dtype, [r.path for r in results])
            print(predict.format_measured(model, results, measured, dtype, c) + "\n", flush=True)
    from vit_fast.tools import calibration

    shipped = calibration.report(dtype, counted=by_model, only=list(by_model))
    if shipped:
        print(shipped + "\n", flush=True)
    return out


if __name__ == "__main__":
    sys.exit(main())
