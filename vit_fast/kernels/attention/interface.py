"""Host side of the attention kernels: validation, launchers and custom ops of both families (flash and
short-sequence), the autograd Functions, the public functionals, the references and the ahead-of-time specs."""
from __future__ import annotations

import functools
import math
from dataclasses import replace
from typing import NamedTuple, Optional

import torch
import torch.nn.functional as F

from .. import _tuning
from .._aot import TRITON_DTYPE_NAMES, AotSpec
from .._tuning import bucket, launcher
from .._utils import (
    cdiv,
    check_float,
    check_kernel_device,
    check_ndim,
    check_shape,
    compute_dtype_for,
    dropout_rate,
    dropout_threshold,
    first_order_only,
    gpu_arch,
    kernel_op,
    next_power_of_2,
    next_seed,
    run_op,
)
from .._utils import input_precision as dot_input_precision
from .common import LAST_STEP, MAX_HEAD_DIM
from .config import (
    STORED_DS_MAX_TOKENS,
    AttentionConfig,
    StoredDsConfig,
    Tile,
    _block_d,
    _block_dims,
    attention_config,
    attention_grid,
    short_config,
    short_refusal,
    short_supported,
    stored_ds_fits,
    stored_ds_row,
)
from .flash_bwd import _attention_bwd_dkdv_kernel, _attention_bwd_dq_stored_kernel, _attention_bwd_kernel
from .flash_fwd import _attention_dropout_mask_kernel, _attention_fwd_kernel, _attention_probs_kernel
from .short_bwd import _attention_short_bwd_kernel, _attention_short_bwd_streamed_kernel
from .short_fwd import _attention_short_fwd_kernel


# ------------------------------------------------------------ validation and launchers (custom ops)
def _head_align(*tensors: torch.Tensor) -> int:
    """The largest of 16, 8, 4, 2, 1 dividing the batch and head strides of every (B, H, N, D) tensor: the
    kernels' HEAD_ALIGN (``_head``)."""
    align = 16
    for t in tensors:
        for stride in t.stride()[:2]:
            while stride % align:
                align //= 2
    return align


def _empty(shape, dtype, device) -> torch.Tensor:
    """Every allocation of the launchers goes through here (tests track and poison it)."""
    return torch.empty(shape, dtype=dtype, device=device)


def _check_head_dim(op: str, head_dim: int) -> None:
    if not 1 <= head_dim <= MAX_HEAD_DIM:
        raise ValueError(f"{op}: expected head_dim in 1..{MAX_HEAD_DIM}, got {head_dim}")


def _check_scale(op: str, scale: float | None) -> None:
    """The kernels mask padded keys with -inf before scaling (the scale rides in the exponent's FFMA), which holds
    for a positive finite scale only."""
    if scale is not None and torch.compiler.is_compiling():
        # dynamo may trace the scale as a symbolic float (a recompile for another model's scale makes it dynamic),
        # which math.isfinite cannot take: the sign is checked when the graph runs
        torch._check(scale > 0)
        return
    if scale is not None and not (isinstance(scale, (int, float)) and math.isfinite(scale) and scale > 0):
        raise ValueError(f"{op}: expected scale a finite number > 0 or None (head_dim ** -0.5), got {scale!r}")


def _check_dropout(op: str, dropout_p: float) -> None:
    if not 0.0 <= dropout_p <= 1.0:
        raise ValueError(f"{op}: expected dropout_p in [0, 1], got {dropout_p}")


def _check_query_rows(op: str, query_rows: int | None, seq_len: int) -> None:
    if query_rows is not None and not (isinstance(query_rows, int) and not isinstance(query_rows, bool)
                                       and 1 <= query_rows <= seq_len):
        raise ValueError(f"{op}: expected query_rows an int in 1..{seq_len} (the tokens) or None, got {query_rows!r}")


def _check_num_heads(op: str, num_heads: int) -> None:
    if not isinstance(num_heads, int) or isinstance(num_heads, bool) or num_heads < 1:
        raise ValueError(f"{op}: expected num_heads to be a positive int, got {num_heads!r}")


def _check_packed(op: str, qkv: torch.Tensor, num_heads: int) -> int:
    """Validate a packed (B, N, 3 * H * D) qkv; returns head_dim."""
    check_float(op, "qkv", qkv)
    check_ndim(op, "qkv", qkv, 3)
    _check_num_heads(op, num_heads)
    width = qkv.shape[-1]
    if width == 0 or width % (3 * num_heads):
        raise ValueError(f"{op}: expected qkv last dim divisible by 3 * num_heads = {3 * num_heads}, got {width}")
    head_dim = width // (3 * num_heads)
    _check_head_dim(op, head_dim)
    if qkv.shape[1] < 1:
        raise ValueError(f"{op}: expected at least one token, got qkv of shape {tuple(qkv.shape)}")
    if not qkv.is_contiguous():
        raise ValueError(f"{op}: expected a contiguous qkv (the qkv Linear's output), got strides {qkv.stride()}")
    return head_dim


def _check_linear(op: str, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, num_heads: int) -> int:
    """x (B, N, C_in), the qkv Linear's weight (3 * H * D, C_in) and optional bias (3 * H * D,), on one
    device that runs the kernels, of one dtype unless autocast picks the GEMM's: checked before the GEMM
    (the qkv it produces then needs no check of its own). Returns head_dim."""
    check_float(op, "x", x)
    check_ndim(op, "x", x, 3)
    if x.shape[1] < 1:
        raise ValueError(f"{op}: expected at least one token, got x of shape {tuple(x.shape)}")
    check_float(op, "weight", weight)
    check_ndim(op, "weight", weight, 2)
    if weight.shape[1] != x.shape[-1]:
        raise ValueError(f"{op}: expected weight of shape (3 * H * D, {x.shape[-1]}) for x of shape "
                         f"{tuple(x.shape)}, got {tuple(weight.shape)}")
    _check_num_heads(op, num_heads)
    if weight.shape[0] == 0 or weight.shape[0] % (3 * num_heads):
        raise ValueError(f"{op}: expected weight rows divisible by 3 * num_heads = {3 * num_heads}, "
                         f"got weight of shape {tuple(weight.shape)}")
    if bias is not None:
        check_float(op, "bias", bias)
        check_shape(op, "bias", bias, (weight.shape[0],))
    for name, t in (("weight", weight), ("bias", bias)):
        if t is not None and t.device != x.device:
            raise ValueError(f"{op}: expected {name} on x's device {x.device}, got {t.device}")
        if t is not None and t.dtype != x.dtype and not torch.is_autocast_enabled(x.device.type):
            raise ValueError(f"{op}: expected {name} with x's dtype {x.dtype} (outside autocast), got {t.dtype}")
    check_kernel_device(op, x)
    head_dim = weight.shape[0] // (3 * num_heads)
    _check_head_dim(op, head_dim)
    return head_dim


def _check_separate(op: str, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
    for name, t in (("q", q), ("k", k), ("v", v)):
        check_float(op, name, t)
        check_ndim(op, name, t, 4)
    if not (q.shape == k.shape == v.shape) or not (q.dtype == k.dtype == v.dtype):
        raise ValueError(f"{op}: expected q, k, v of one shape (B, H, N, D) and dtype, got "
                         f"{tuple(q.shape)} {q.dtype}, {tuple(k.shape)} {k.dtype}, {tuple(v.shape)} {v.dtype}")
    if q.shape[2] < 1:
        raise ValueError(f"{op}: expected at least one token, got q of shape {tuple(q.shape)}")
    _check_head_dim(op, q.shape[-1])


def _split_packed(qkv: torch.Tensor, num_heads: int):
    """(B, H, N, D) views of q, k, v inside the packed (B, N, 3 * H * D) qkv (no copy)."""
    B, N, width = qkv.shape
    return qkv.view(B, N, 3, num_heads, width // (3 * num_heads)).permute(2, 0, 3, 1, 4).unbind(0)


def _heads_view(t: torch.Tensor, num_heads: int) -> torch.Tensor:
    """(B, N, H * D) -> (B, H, N, D) view (reshape semantics, so an expanded grad also works)."""
    return t.unflatten(-1, (num_heads, t.shape[-1] // num_heads)).transpose(1, 2)


def _dropout_args(dropout_p: float) -> tuple[bool, int, float]:
    """(draw a mask at all, the 8-bit threshold t, the scale 1 / (1 - t / 256) of kept values, 0 when t == 256)."""
    threshold = dropout_threshold(dropout_p)
    return threshold > 0, threshold, (0.0 if threshold >= 256 else 256.0 / (256 - threshold))


class _FlashPlan(NamedTuple):
    """What a flash launch derives from its tensors' layout (``LaunchPlans``): q, k, v, out (and for the backward
    dO, dq, dk, dv) shapes, strides and dtype, the dropout rate, the dot precision and the GPU architecture."""

    strides: tuple  # every tensor's four strides, in the kernel's argument order
    precision: str
    dropout: bool
    threshold: int
    inv_keep: float
    head_align: int
    launch: _tuning.LaunchPlan  # the tuning key, the candidates and a bound launch per config


def _flash_plan(op: str, tensors: tuple, q_len: int, dropout_p: float, precision: str, arch: int) -> _FlashPlan:
    q = tensors[0]
    B, H, N, D = q.shape
    dropout, threshold, inv_keep = _dropout_args(dropout_p)
    static = attention_config(N, D, q.dtype, arch, precision, dropout)
    # q_len < N (the last block's class-token query) is its own tuning entry: it must not pick the full launches';
    # batch x heads too: a batch-1 call (a sanity pass) fills a few SMs, where the best tile is another one
    key = (bucket(N), D, str(q.dtype), arch, precision, dropout, q_len == N, bucket(B * H))
    if op == "attention_fwd":
        candidates = _fwd_candidates(static.fwd, D)
    elif stored_ds_only.on:
        candidates = (StoredDsConfig.of(static),)
    else:
        candidates = _bwd_candidates(static)
        offered = not one_launch_only.on and stored_ds_fits(B * H, q_len, N, q.element_size())
        if offered:  # in the key: offered or not, another choice
            key, candidates = key + ("stored_ds",), candidates + (StoredDsConfig.of(static),)
    strides = tuple(stride for t in tensors for stride in t.stride())
    plan = _FlashPlan(strides, precision, dropout, threshold, inv_keep, _head_align(*tensors), None)
    bind = functools.partial(_bind_fwd if op == "attention_fwd" else _bind_bwd, plan, (B, H, N, D), q_len)
    return plan._replace(launch=_tuning.LaunchPlan(op, key, candidates, bind))


def _bind_fwd(plan: _FlashPlan, shape: tuple, q_len: int, cfg: Tile):
    """The flash forward on ``cfg``: launch(q, k, v, out, lse, scale, seed)."""
    B, H, N, D = shape
    block_d, tail = _block_dims(D, cfg.split)
    grid = attention_grid(B * H, q_len, cfg.block_m)
    kernel = _tuning.KernelLaunch(_attention_fwd_kernel, grid, BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n,
                                  BLOCK_D=block_d, BLOCK_D_TAIL=tail, DROPOUT=plan.dropout,
                                  INPUT_PRECISION=plan.precision, TAIL_N=LAST_STEP, PEEL=cfg.peel,
                                  HEAD_ALIGN=plan.head_align, num_warps=cfg.num_warps, num_stages=cfg.num_stages)
    strides, threshold, inv_keep = plan.strides, plan.threshold, plan.inv_keep

    def launch(q, k, v, out, lse, scale, seed):
        kernel(out, lse, q, k, v, *strides, H, N, D, q_len, scale, threshold, inv_keep, seed)
    return launch


def _bind_bwd(plan: _FlashPlan, shape: tuple, q_len: int, cfg: AttentionConfig | StoredDsConfig):
    """The flash backward on ``cfg``: launch(do, q, k, v, out, lse, dq, dk, dv, scale, seed)."""
    if isinstance(cfg, StoredDsConfig):
        return _bind_stored_ds_bwd(plan, shape, q_len, cfg)
    B, H, N, D = shape
    block_d, tail = _block_dims(D, cfg.dq.split)
    grid = attention_grid(B * H, N, cfg.dq.block_m)
    kernel = _tuning.KernelLaunch(_attention_bwd_kernel, grid, BLOCK=cfg.dq.block_m, KV_BLOCK_M=cfg.dkdv.block_m,
                                  Q_BLOCK_N=cfg.dq.block_n, BLOCK_D=block_d, BLOCK_D_TAIL=tail, DROPOUT=plan.dropout,
                                  INPUT_PRECISION=plan.precision, TAIL=LAST_STEP, PEEL=cfg.dq.peel,
                                  HEAD_ALIGN=plan.head_align, num_warps=cfg.dq.num_warps,
                                  num_stages=cfg.dq.num_stages)
    strides, threshold, inv_keep = plan.strides[:24], plan.threshold, plan.inv_keep

    def launch(do, q, k, v, out, lse, dq, dk, dv, scale, seed):
        kernel(dq, dk, dv, q, k, v, out, do, lse, *strides, H, N, D, q_len, scale, threshold, inv_keep, seed)
    return launch


# inside ``with stored_ds_only():`` every flash backward runs the stored-dS launches (``StoredDsConfig``) on the
# static tiles, whatever its length or the autotuner would pick (the tests and `vit-fast check` compare it)
stored_ds_only = _tuning.ProcessSwitch()
# inside ``with one_launch_only():`` the stored-dS candidate is not offered: the autotuner picks among the one-launch
# tiles alone (the GPU probe's A/B of the two algorithms)
one_launch_only = _tuning.ProcessSwitch()

_FWD_PLANS = _tuning.LaunchPlans(functools.partial(_flash_plan, "attention_fwd"))
_BWD_PLANS = _tuning.LaunchPlans(functools.partial(_flash_plan, "attention_bwd"))


def _launch_fwd(q, k, v, out, lse, scale: float, dropout_p: float, seed: Optional[torch.Tensor]) -> None:
    """out (B, H, M, D) and lse (B, H, M) of the first M = out.shape[2] query rows (M <= N)."""
    precision, arch = dot_input_precision(q.dtype), gpu_arch(q.device)  # read per launch: torch's tf32 flag
    launches = _FWD_PLANS.get((q.shape, q.stride(), k.stride(), v.stride(), out.shape, out.stride(), q.dtype,
                               dropout_p, precision, arch, q.device), (q, k, v, out), out.shape[2], dropout_p,
                              precision, arch).launch

    def launch(cfg: Tile) -> None:
        launches.bind(cfg)(q, k, v, out, lse, scale, seed)
    launch(launches.choose(q.device, launch))


def _launch_bwd(do, q, k, v, out, lse, dq, dk, dv, scale: float, dropout_p: float,
                seed: Optional[torch.Tensor]) -> None:
    """dq, dk, dv (which share one stride layout) in one launch, or two for the stored-dS candidate
    (``StoredDsConfig``). out, dO and lse may hold the first M < N query rows only (the forward's): the other rows
    of dq are written as zeros."""
    precision, arch = dot_input_precision(q.dtype), gpu_arch(q.device)
    # the kernel's argument order: q, k, v, out, dO, then dq (dk and dv share its layout)
    launches = _BWD_PLANS.get((q.shape, q.stride(), k.stride(), v.stride(), out.shape, out.stride(), do.stride(),
                               dq.stride(), dk.stride(), dv.stride(), q.dtype, dropout_p, precision, arch, q.device,
                               stored_ds_only.on, one_launch_only.on), (q, k, v, out, do, dq, dk, dv), out.shape[2],
                              dropout_p, precision, arch).launch

    def launch(cfg: AttentionConfig | StoredDsConfig) -> None:
        launches.bind(cfg)(do, q, k, v, out, lse, dq, dk, dv, scale, seed)
    launch(launches.choose(q.device, launch))


def _packed_views(qkv: torch.Tensor, out: torch.Tensor, grad_out: Optional[torch.Tensor], num_heads: int) -> tuple:
    """The (B, H, N, D) views the flash launchers take, of the packed qkv and out (and for the backward grad_out and
    a dqkv laid out as a contiguous qkv), in ``_flash_plan``'s order: built once per layout, for the plan."""
    q, k, v = _split_packed(qkv, num_heads)
    if grad_out is None:
        return q, k, v, _heads_view(out, num_heads)
    dq, dk, dv = _split_packed(torch.empty(qkv.shape, dtype=qkv.dtype, device="meta"), num_heads)
    return q, k, v, _heads_view(out, num_heads), _heads_view(grad_out, num_heads), dq, dk, dv


_PACKED_FWD_PLANS = _tuning.LaunchPlans(
    lambda qkv, out, num_heads, dropout_p, precision, arch: _flash_plan(
        "attention_fwd", _packed_views(qkv, out, None, num_heads), out.shape[1], dropout_p, precision, arch))
_PACKED_BWD_PLANS = _tuning.LaunchPlans(
    lambda qkv, out, grad_out, num_heads, dropout_p, precision, arch: _flash_plan(
        "attention_bwd", _packed_views(qkv, out, grad_out, num_heads), out.shape[1], dropout_p, precision, arch))


def _launch_packed_fwd(qkv, out, lse, num_heads: int, scale: float, dropout_p: float,
                       seed: Optional[torch.Tensor]) -> None:
    """``_launch_fwd`` on the packed tensors (qkv (B, N, 3 * H * D), out (B, M, H * D)): the plan, built once per
    layout, holds the per-head strides, so a call passes qkv and its k and v column slices for their pointers
    instead of building the per-head views (the same launches, argument for argument)."""
    precision, arch = dot_input_precision(qkv.dtype), gpu_arch(qkv.device)
    launches = _PACKED_FWD_PLANS.get((qkv.shape, qkv.stride(), out.shape, out.stride(), qkv.dtype, num_heads,
                                      dropout_p, precision, arch, qkv.device), qkv, out, num_heads, dropout_p,
                                     precision, arch).launch
    width = out.shape[-1]
    k, v = qkv[..., width:], qkv[..., 2 * width:]

    def launch(cfg: Tile) -> None:
        launches.bind(cfg)(qkv, k, v, out, lse, scale, seed)
    launch(launches.choose(qkv.device, launch))


def _launch_packed_bwd(grad_out, qkv, out, lse, dqkv, num_heads: int, scale: float, dropout_p: float,
                       seed: Optional[torch.Tensor]) -> None:
    """``_launch_bwd`` on the packed tensors (``_launch_packed_fwd``), dqkv a contiguous tensor of qkv's shape."""
    precision, arch = dot_input_precision(qkv.dtype), gpu_arch(qkv.device)
    launches = _PACKED_BWD_PLANS.get((qkv.shape, qkv.stride(), out.shape, out.stride(), grad_out.stride(), qkv.dtype,
                                      num_heads, dropout_p, precision, arch, qkv.device, stored_ds_only.on,
                                      one_launch_only.on), qkv, out, grad_out, num_heads, dropout_p, precision,
                                     arch).launch
    width = out.shape[-1]
    k, v, dk, dv = qkv[..., width:], qkv[..., 2 * width:], dqkv[..., width:], dqkv[..., 2 * width:]

    def launch(cfg: AttentionConfig | StoredDsConfig) -> None:
        launches.bind(cfg)(grad_out, qkv, k, v, out, lse, dqkv, dk, dv, scale, seed)
    launch(launches.choose(qkv.device, launch))


def _bind_stored_ds_bwd(plan: _FlashPlan, shape: tuple, q_len: int, cfg: StoredDsConfig):
    """The backward as ``StoredDsConfig``'s two launches (``_launch_stored_ds_bwd``), their grids and constexprs
    bound once."""
    B, H, N, D = shape
    block_d, tail = _block_dims(D, cfg.dkdv.split)
    dkdv = _tuning.KernelLaunch(_attention_bwd_dkdv_kernel, attention_grid(B * H, N, cfg.dkdv.block_n),
                                BLOCK=cfg.dkdv.block_n, KV_BLOCK_M=cfg.dkdv.block_m, BLOCK_D=block_d,
                                BLOCK_D_TAIL=tail, DROPOUT=plan.dropout, INPUT_PRECISION=plan.precision,
                                TAIL=LAST_STEP, PEEL=cfg.dkdv.peel, HEAD_ALIGN=plan.head_align,
                                num_warps=cfg.dkdv.num_warps, num_stages=cfg.dkdv.num_stages)
    block_d, tail = _block_dims(D, cfg.dq.split)
    dq = _tuning.KernelLaunch(_attention_bwd_dq_stored_kernel, attention_grid(B * H, N, cfg.dq.block_m),
                              BLOCK_M=cfg.dq.block_m, BLOCK_N=cfg.dq.block_n, BLOCK_D=block_d, BLOCK_D_TAIL=tail,
                              INPUT_PRECISION=plan.precision, TAIL=LAST_STEP, HEAD_ALIGN=plan.head_align,
                              num_warps=cfg.dq.num_warps, num_stages=cfg.dq.num_stages)
    kernels = (dkdv, dq)
    return lambda *args: _launch_stored_ds_bwd(cfg, plan, kernels, shape, q_len, *args)


def _launch_stored_ds_bwd(cfg: StoredDsConfig, plan: _FlashPlan, kernels: tuple, shape: tuple, q_len: int, do, q, k,
                          v, out, lse, dq, dk, dv, scale: float, seed: Optional[torch.Tensor]) -> None:
    """The backward as ``StoredDsConfig``: dK, dV and the dS workspace (B * H, q_len, N padded to 16) in one launch,
    then dQ from it (rows past q_len zeros) in a second; ``kernels``: the two launches (``_bind_stored_ds_bwd``).
    The tensors give their pointers only (the packed launchers pass column slices): the plan holds the layout."""
    B, H, N, D = shape
    row = stored_ds_row(N)
    ds = _empty((B * H, q_len, row), q.dtype, q.device)
    dkdv_kernel, dq_kernel = kernels
    dkdv_kernel(dk, dv, ds, q, k, v, out, do, lse, *plan.strides[:24], row, H, N, D, q_len, scale, plan.threshold,
                plan.inv_keep, seed)
    dq_kernel(dq, ds, k, *plan.strides[4:8], *plan.strides[20:24], row, H, N, D, q_len, scale)


def _launch_short_fwd(q, k, v, out, lse, scale: float, dropout_p: float, seed: Optional[torch.Tensor]) -> None:
    """The short-sequence forward (short_fwd.py): out and lse of the first M = out.shape[2] query rows; where one
    program cannot hold the head (``ShortConfig.fwd`` None), the flash forward (same out, lse and dropout bits)."""
    B, H, N, D = q.shape
    q_len = out.shape[2]
    dropout, threshold, inv_keep = _dropout_args(dropout_p)
    cfg = short_config(N, D, q.dtype, gpu_arch(q.device), dropout)
    if cfg.fwd is None:
        _launch_fwd(q, k, v, out, lse, scale, dropout_p, seed)
        return
    launcher(_attention_short_fwd_kernel, attention_grid(B * H, q_len, cfg.fwd.block_m))(
        out, lse, q, k, v, *q.stride(), *k.stride(), *v.stride(), *out.stride(),
        H, N, D, q_len, scale, threshold, inv_keep, seed,
        BLOCK_M=cfg.fwd.block_m, **cfg.segment_constexprs("KEYS"), BLOCK_D=_block_d(D), DROPOUT=dropout,
        INPUT_PRECISION=dot_input_precision(q.dtype), HEAD_ALIGN=_head_align(q, k, v, out),
        num_warps=cfg.fwd.num_warps, num_stages=cfg.fwd.num_stages)


def _launch_short_bwd(do, q, k, v, out, lse, dq, dk, dv, scale: float, dropout_p: float,
                      seed: Optional[torch.Tensor]) -> None:
    """The short-sequence backward (short_bwd.py), one program per (image, head), dQ in registers or, past
    ``SHORT_CAPACITY``, in an fp32 workspace."""
    B, H, N, D = q.shape
    q_len = out.shape[2]
    dropout, threshold, inv_keep = _dropout_args(dropout_p)
    cfg = short_config(N, D, q.dtype, gpu_arch(q.device), dropout)
    common = dict(BLOCK_N=cfg.bwd.block_n, BLOCK_D=_block_d(D), DROPOUT=dropout,
                  INPUT_PRECISION=dot_input_precision(q.dtype), HEAD_ALIGN=_head_align(q, k, v, out, do, dq, dk, dv),
                  num_warps=cfg.bwd.num_warps, num_stages=cfg.bwd.num_stages)
    strides = (*q.stride(), *k.stride(), *v.stride(), *out.stride(), *do.stride(), *dq.stride())
    values = (H, N, D, q_len, scale, threshold, inv_keep, seed)
    if cfg.dq_workspace:
        delta = _empty((B * H, q_len), torch.float32, q.device)
        dq_acc = _empty((B * H, q_len, _block_d(D)), torch.float32, q.device)
        launcher(_attention_short_bwd_streamed_kernel, attention_grid(B * H, 1, 1))(
            dq, dk, dv, q, k, v, out, do, lse, delta, dq_acc, *strides, *values,
            BLOCK_M=cfg.bwd.block_m, **common)
    else:
        launcher(_attention_short_bwd_kernel, attention_grid(B * H, 1, 1))(
            dq, dk, dv, q, k, v, out, do, lse, *strides, *values, **cfg.segment_constexprs("ROWS"),
            **common)


@functools.lru_cache(maxsize=None)
def _fwd_candidates(static: Tile, head_dim: int) -> tuple[Tile, ...]:
    """The static tile, then the q rows halved (for heads up to 80 wide, from 128 rows on 8 warps to 64 on 4: on
    sm_90 one warpgroup's wgmma rows; on the H200 (torch 2.11, triton 3.6, 2026-11-26) 64 rows on the same 8 warps
    took 0.328 ms at ViT-B/16 b256 against 0.193; 128-wide heads keep 8 warps, their 4-warp sm_80 build spills
    64 B), the keys per step halved, the warps doubled."""
    candidates = _tuning.tile_candidates(static)
    if static.block_m >= 128 and static.num_warps == 8 and head_dim <= 80:
        candidates = [replace(c, num_warps=4) if (c.block_m, c.block_n) == (static.block_m // 2, static.block_n)
                      else c for c in candidates]
    return tuple(candidates)


@functools.lru_cache(maxsize=None)  # asked on every backward launch: built once per config
def _bwd_candidates(static: AttentionConfig) -> tuple[AttentionConfig, ...]:
    """The static backward config, then: the rows each program owns halved (both phases; from sm_90's 128 rows on 8
    warps to 64 on 4, one warpgroup's wgmma rows: on the H200 (torch 2.11, triton 3.6, 2026-11-26) 64 rows on the
    same 8 warps took 1.72 ms at ViT-B/16 b256 against 0.98), the q rows per dK/dV step halved, the k/v rows per dQ
    step halved, the warps doubled (both phases share the launch); on sm_90's 16-bit D <= 64 tile also the q rows
    per dK/dV step doubled."""
    dkdv, dq = static.dkdv, static.dq
    pairs = [(dkdv, dq)]
    if dq.block_m >= 32:
        warps = 4 if dq.block_m >= 128 and dq.num_warps == 8 else dq.num_warps
        pairs.append((replace(dkdv, block_n=dkdv.block_n // 2, num_warps=warps),
                      replace(dq, block_m=dq.block_m // 2, num_warps=warps)))
    if dkdv.block_m >= 32:
        pairs.append((replace(dkdv, block_m=dkdv.block_m // 2), dq))
    if dq.block_n >= 32:
        pairs.append((dkdv, replace(dq, block_n=dq.block_n // 2)))
    if dq.num_warps < 8:
        pairs.append((replace(dkdv, num_warps=8), replace(dq, num_warps=8)))
    if (dkdv.block_n, dkdv.block_m, dkdv.num_warps, dkdv.split) == (128, 32, 8, False):
        # sm_90's 16-bit D <= 64 tile with 64-row dK/dV steps: no bias partials in the kernel any more, so it
        # compiles without spills with and without dropout (246 / 251 registers, sm_90, triton 3.8, 2026-11-28)
        pairs.append((replace(dkdv, block_m=64), dq))
    return tuple(AttentionConfig(static.fwd, d, q) for d, q in pairs)


# Custom ops: torch.compile(fullgraph=True) traces through them; the autograd Functions call them.
def _packed_fwd(launch, qkv, num_heads, scale, dropout_p, seed, query_rows):
    """Packed forward: qkv (B, N, 3 * H * D) -> (out (B, M, H * D), lse (B, H, M) fp32) for the first
    M = query_rows queries (every token still a key and value), by ``launch`` (either family's packed launcher).
    Inputs were validated by the calling functional."""
    B, N, width = qkv.shape
    out = _empty((B, query_rows, width // 3), qkv.dtype, qkv.device)
    lse = _empty((B, num_heads, query_rows), torch.float32, qkv.device)
    launch(qkv, out, lse, num_heads, scale, dropout_p, seed)
    return out, lse


def _launch_short_packed_fwd(qkv, out, lse, num_heads, scale, dropout_p, seed) -> None:
    _launch_short_fwd(*_split_packed(qkv, num_heads), _heads_view(out, num_heads), lse, scale, dropout_p, seed)


def _launch_short_packed_bwd(grad_out, qkv, out, lse, dqkv, num_heads, scale, dropout_p, seed) -> None:
    _launch_short_bwd(_heads_view(grad_out, num_heads), *_split_packed(qkv, num_heads), _heads_view(out, num_heads),
                      lse, *_split_packed(dqkv, num_heads), scale, dropout_p, seed)


def _packed_bwd(op, launch, grad_out, qkv, qkv_bias, out, lse, num_heads, scale, dropout_p, seed):
    """Packed backward: (dqkv, dbias). dqkv is one (B, N, 3 * H * D) gradient with dQ, dK, dV written
    into its three slices (dQ zero past the forward's query rows, out.shape[1]); with ``qkv_bias`` (the bias
    already inside qkv: only its presence and dtype matter here) dbias (3 * H * D,) in the bias dtype is the
    sum of dqkv over batch and tokens, else an empty tensor (custom ops cannot return None)."""
    check_kernel_device(op, grad_out, qkv, qkv_bias, out, lse)
    if grad_out.shape != out.shape:
        raise ValueError(f"{op}: expected grad_out of shape {tuple(out.shape)}, got {tuple(grad_out.shape)}")
    dqkv = _empty(qkv.shape, qkv.dtype, qkv.device)
    launch(grad_out, qkv, out, lse, dqkv, num_heads, scale, dropout_p, seed)
    if qkv_bias is None:
        return dqkv, qkv.new_empty(0)
    # torch's column sum of the rounded d(qkv), as eager's addmm backward (no atomics: bitwise repeatable); in the
    # kernels' epilogues the same sums cost 0.29 ms against 0.075 per ViT-B/16 b256 block on the H200 (torch
    # 2.11, triton 3.6, 2026-11-27)
    return dqkv, dqkv.view(-1, dqkv.shape[-1]).sum(0, dtype=torch.float32).to(qkv_bias.dtype)


def _packed_fwd_fake(qkv, num_heads, scale, dropout_p, seed, query_rows):
    B, N, width = qkv.shape
    return qkv.new_empty((B, query_rows, width // 3)), qkv.new_empty((B, num_heads, query_rows), dtype=torch.float32)


def _packed_bwd_fake(grad_out, qkv, qkv_bias, out, lse, num_heads, scale, dropout_p, seed):
    return torch.empty_like(qkv), qkv.new_empty(0) if qkv_bias is None else torch.empty_like(qkv_bias)


@kernel_op("vit_fast::attention_fwd")
def attention_fwd(qkv: torch.Tensor, num_heads: int, scale: float, dropout_p: float,
                  seed: Optional[torch.Tensor], query_rows: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The flash family's packed forward (``_packed_fwd``)."""
    return _packed_fwd(_launch_packed_fwd, qkv, num_heads, scale, dropout_p, seed, query_rows)


@kernel_op("vit_fast::attention_bwd")
def attention_bwd(grad_out: torch.Tensor, qkv: torch.Tensor, qkv_bias: Optional[torch.Tensor], out: torch.Tensor,
                  lse: torch.Tensor, num_heads: int, scale: float, dropout_p: float,
                  seed: Optional[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """The flash family's packed backward (``_packed_bwd``)."""
    return _packed_bwd("attention_bwd", _launch_packed_bwd, grad_out, qkv, qkv_bias, out, lse, num_heads, scale,
                       dropout_p, seed)


@kernel_op("vit_fast::attention_short_fwd")
def attention_short_fwd(qkv: torch.Tensor, num_heads: int, scale: float, dropout_p: float,
                        seed: Optional[torch.Tensor], query_rows: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The short-sequence family's packed forward (``_packed_fwd``)."""
    return _packed_fwd(_launch_short_packed_fwd, qkv, num_heads, scale, dropout_p, seed, query_rows)


@kernel_op("vit_fast::attention_short_bwd")
def attention_short_bwd(grad_out: torch.Tensor, qkv: torch.Tensor, qkv_bias: Optional[torch.Tensor],
                        out: torch.Tensor, lse: torch.Tensor, num_heads: int, scale: float, dropout_p: float,
                        seed: Optional[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """The short-sequence family's packed backward (``_packed_bwd``)."""
    return _packed_bwd("attention_short_bwd", _launch_short_packed_bwd, grad_out, qkv, qkv_bias, out, lse, num_heads,
                       scale, dropout_p, seed)


for _op in (attention_fwd, attention_short_fwd):
    _op.register_fake(_packed_fwd_fake)
for _op in (attention_bwd, attention_short_bwd):
    _op.register_fake(_packed_bwd_fake)
# the (forward, backward) custom ops of each kernel family
FAMILY_OPS = {"flash": (attention_fwd, attention_bwd), "short": (attention_short_fwd, attention_short_bwd)}
KERNELS = tuple(FAMILY_OPS)


@kernel_op("vit_fast::attention_qkv_fwd")
def attention_qkv_fwd(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, dropout_p: float,
                      seed: Optional[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """Separate (B, H, N, D) q, k, v of any strides -> (out (B, H, N, D) contiguous, lse (B, H, N)).
    Inputs were validated by ``attention_qkv``."""
    B, H, N, D = q.shape
    out = _empty((B, H, N, D), q.dtype, q.device)
    lse = _empty((B, H, N), torch.float32, q.device)
    _launch_fwd(q, k, v, out, lse, scale, dropout_p, seed)
    return out, lse


@attention_qkv_fwd.register_fake
def _(q, k, v, scale, dropout_p, seed):
    return torch.empty_like(q, memory_format=torch.contiguous_format), q.new_empty(q.shape[:3], dtype=torch.float32)


@kernel_op("vit_fast::attention_qkv_bwd")
def attention_qkv_bwd(grad_out: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor,
                      lse: torch.Tensor, scale: float, dropout_p: float,
                      seed: Optional[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    check_kernel_device("attention_qkv_bwd", grad_out, q, k, v, out, lse)
    if grad_out.shape != q.shape:
        raise ValueError(f"attention_qkv_bwd: expected grad_out of shape {tuple(q.shape)}, got {tuple(grad_out.shape)}")
    dq, dk, dv = (_empty(q.shape, q.dtype, q.device) for _ in range(3))
    _launch_bwd(grad_out, q, k, v, out, lse, dq, dk, dv, scale, dropout_p, seed)
    return dq, dk, dv


@attention_qkv_bwd.register_fake
def _(grad_out, q, k, v, out, lse, scale, dropout_p, seed):
    return tuple(torch.empty_like(q, memory_format=torch.contiguous_format) for _ in range(3))


def _check_attention(op: str, qkv: torch.Tensor, num_heads: int, dropout_p: float, scale: float | None) -> int:
    """Every check of the packed functionals, once per call; returns head_dim."""
    head_dim = _check_packed(op, qkv, num_heads)
    _check_dropout(op, dropout_p)
    _check_scale(op, scale)
    check_kernel_device(op, qkv)
    return head_dim


# ----------------------------------------------------------------------------------------- autograd
class AttentionFunction(torch.autograd.Function):
    """qkv_bias: the qkv Linear's bias already inside qkv (added by the GEMM with the bias detached), or
    None. It is an input only so that the backward returns its gradient, the column sum of d(qkv).
    ``kernel``: the family ('flash' or 'short', ``FAMILY_OPS``) running both passes."""

    @staticmethod
    def forward(ctx, qkv, qkv_bias, num_heads, scale, dropout_p, seed, query_rows, kernel):
        fwd, ctx.bwd = FAMILY_OPS[kernel]
        out, lse = run_op(fwd, qkv, num_heads, scale, dropout_p, seed, query_rows)
        ctx.save_for_backward(qkv, qkv_bias, out, lse, seed)
        ctx.set_materialize_grads(False)  # no zero-filled grad for the non-differentiable lse
        ctx.args = (num_heads, scale, dropout_p)
        ctx.mark_non_differentiable(lse)
        return out, lse

    @staticmethod
    @first_order_only  # a gradient under create_graph=True raises: no second derivative
    def backward(ctx, grad_out, grad_lse):
        qkv, qkv_bias, out, lse, seed = ctx.saved_tensors
        dqkv, dbias = run_op(ctx.bwd, grad_out, qkv, qkv_bias, out, lse, *ctx.args, seed)
        return dqkv, (dbias if qkv_bias is not None else None), None, None, None, None, None, None


class AttentionQKVFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, scale, dropout_p, seed):
        out, lse = run_op(attention_qkv_fwd, q, k, v, scale, dropout_p, seed)
        ctx.save_for_backward(q, k, v, out, lse, seed)
        ctx.set_materialize_grads(False)  # no zero-filled grad for the non-differentiable lse
        ctx.args = (scale, dropout_p)
        ctx.mark_non_differentiable(lse)
        return out, lse

    @staticmethod
    @first_order_only  # a gradient under create_graph=True raises: no second derivative
    def backward(ctx, grad_out, grad_lse):
        *tensors, seed = ctx.saved_tensors
        return *run_op(attention_qkv_bwd, grad_out, *tensors, *ctx.args, seed), None, None, None


# --------------------------------------------------------------------------------------- functional
def _dropout_and_seed(dropout_p: float, training: bool,
                      device: torch.device) -> tuple[float, Optional[torch.Tensor]]:
    """(p, seed): a ``next_seed(device)`` tensor only when dropout is active (else None, nothing drawn).
    dropout_p was checked by the caller."""
    p = float(dropout_p) if training else 0.0
    return p, (next_seed(device) if dropout_threshold(p) > 0 else None)


def _attention_with_lse(qkv: torch.Tensor, num_heads: int, head_dim: int, scale: float | None, dropout_p: float,
                        training: bool, qkv_bias: torch.Tensor | None = None,
                        query_rows: int | None = None, kernel: str = "flash") -> tuple[torch.Tensor, torch.Tensor]:
    """The packed path after validation (done once, by the public functional that calls this)."""
    p, seed = _dropout_and_seed(dropout_p, training, qkv.device)
    scale = head_dim**-0.5 if scale is None else float(scale)
    rows = qkv.shape[1] if query_rows is None else query_rows
    return AttentionFunction.apply(qkv, qkv_bias, num_heads, scale, p, seed, rows, kernel)


def family_for(preferred: str, seq_len: int, head_dim: int, dtype: torch.dtype) -> str:
    """The family a fused attention runs: 'short' where ``preferred`` and the short kernels run this head
    (``short_supported``; dropout only moves them from held to streamed), else 'flash' (which runs any N)."""
    return "short" if preferred == "short" and short_supported(seq_len, head_dim, dtype) else "flash"


def _check_kernel(op: str, kernel: str, seq_len: int, head_dim: int, dtype: torch.dtype) -> None:
    """``kernel`` names a family, and the short one only where it holds the head (``short_supported``)."""
    if kernel not in KERNELS:
        raise ValueError(f"{op}: expected kernel one of {list(KERNELS)}, got {kernel!r}")
    refusal = kernel == "short" and short_refusal(seq_len, head_dim, dtype)
    if refusal:
        raise ValueError(refusal)


def attention_with_lse(qkv: torch.Tensor, num_heads: int, scale: float | None = None, dropout_p: float = 0.0,
                       training: bool = False, kernel: str = "flash") -> tuple[torch.Tensor, torch.Tensor]:
    """``attention`` that also returns the fp32 log-sum-exp (B, H, N) for ``attention_probs``."""
    head_dim = _check_attention("attention", qkv, num_heads, dropout_p, scale)
    _check_kernel("attention", kernel, qkv.shape[1], head_dim, qkv.dtype)
    return _attention_with_lse(qkv, num_heads, head_dim, scale, dropout_p, training, kernel=kernel)


def attention(qkv: torch.Tensor, num_heads: int, scale: float | None = None, dropout_p: float = 0.0,
              training: bool = False, kernel: str = "flash") -> torch.Tensor:
    """softmax(q k^T * scale) v from the packed qkv (B, N, 3 * H * D) -> (B, N, H * D).

    ``dropout_p`` (in [0, 1], applied when ``training``) is quantised to a multiple of 1/256: the kernels
    drop t / 256 of the probabilities, t = round(256 p) (p = 0.1 -> 26/256), and scale the rest by
    1 / (1 - t / 256); ``dropout_rate(p)`` returns the rate applied. The same holds for every functional
    here (``attention_linear``, ``attention_qkv``, ``attention_with_lse``).

    ``kernel``: 'flash' (any N) or 'short' (the short-sequence family, fp16/bf16 where a whole head fits on
    chip, ``short_supported``; the same numbers within rounding, the same dropout mask for a seed)."""
    head_dim = _check_attention("attention", qkv, num_heads, dropout_p, scale)
    _check_kernel("attention", kernel, qkv.shape[1], head_dim, qkv.dtype)
    return _attention_with_lse(qkv, num_heads, head_dim, scale, dropout_p, training, kernel=kernel)[0]


def attention_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, num_heads: int,
                     scale: float | None = None, dropout_p: float = 0.0, training: bool = False,
                     return_lse: bool = False, query_rows: int | None = None, kernel: str = "flash"):
    """The qkv Linear then ``attention``: attention(F.linear(x, weight, bias), num_heads) -> (B, N, H * D), or
    (B, M, H * D) with ``query_rows`` = M.

    The bias rides in the GEMM's epilogue (cuBLAS; under autocast cast like eager's, so qkv is bitwise
    eager timm's) and its gradient is the attention backward's fp32 column sum of d(qkv): the Linear sees the
    bias detached, the attention Function returns d(bias).
    ``return_lse``: also return the fp32 log-sum-exp (B, H, N), (B, H, M) with query_rows, for
    ``attention_probs`` (which needs all N rows, so no query_rows, and takes
    the biased qkv, F.linear(x, weight, bias)). ``query_rows`` = M: only the first M tokens' output,
    (B, M, H * D), bitwise ``attention_linear(...)[:, :M]``; every token is still a key and value, the
    kernels skip the other queries (the last block under class-token pooling needs token 0 only).
    ``kernel``: the family, as for ``attention`` (checked on the GEMM's output dtype, autocast's)."""
    head_dim = _check_linear("attention_linear", x, weight, bias, num_heads)
    _check_dropout("attention_linear", dropout_p)
    _check_scale("attention_linear", scale)
    _check_query_rows("attention_linear", query_rows, x.shape[1])
    _check_kernel("attention_linear", kernel, x.shape[1], head_dim, compute_dtype_for(x))
    qkv = F.linear(x, weight, None if bias is None else bias.detach())  # contiguous (B, N, 3 * H * D)
    grad_bias = bias if bias is not None and bias.requires_grad and torch.is_grad_enabled() else None
    out, lse = _attention_with_lse(qkv, num_heads, head_dim, scale, dropout_p, training, grad_bias, query_rows,
                                   kernel)
    return (out, lse) if return_lse else out


def attention_qkv(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float | None = None,
                  dropout_p: float = 0.0, training: bool = False) -> torch.Tensor:
    """softmax(q k^T * scale) v for (B, H, N, D) tensors of any strides -> (B, H, N, D)."""
    _check_separate("attention_qkv", q, k, v)
    _check_dropout("attention_qkv", dropout_p)
    _check_scale("attention_qkv", scale)
    check_kernel_device("attention_qkv", q, k, v)
    p, seed = _dropout_and_seed(dropout_p, training, q.device)
    scale = q.shape[-1] ** -0.5 if scale is None else float(scale)
    return AttentionQKVFunction.apply(q, k, v, scale, p, seed)[0]


def attention_probs(qkv: torch.Tensor, lse: torch.Tensor, num_heads: int, scale: float | None = None,
                    rows=None) -> torch.Tensor:
    """Exact attention probabilities (before dropout) recomputed from the forward's lse.

    Returns fp32 (B, H, len(rows), N) for the chosen query rows (e.g. rows=[0], the class token),
    or the full (B, H, N, N) map when rows is None. Runs in tiles; nothing but the result is stored.
    Pass the same ``qkv`` as to ``attention_with_lse`` (for ``attention_linear``: the biased
    F.linear(x, weight, bias)).
    """
    head_dim = _check_packed("attention_probs", qkv, num_heads)
    check_kernel_device("attention_probs", qkv, lse)
    B, N, _ = qkv.shape
    if lse.shape != (B, num_heads, N) or lse.dtype != torch.float32:
        raise ValueError(f"attention_probs: expected lse of shape {(B, num_heads, N)} and dtype float32, "
                         f"got {tuple(lse.shape)} {lse.dtype}")
    _check_scale("attention_probs", scale)
    rows = torch.arange(N) if rows is None else torch.as_tensor(rows)
    if rows.numel() and (rows.dtype.is_floating_point or rows.dtype.is_complex or rows.dtype == torch.bool):
        raise ValueError(f"attention_probs: expected rows as integer indices (a list or an integer tensor), "
                         f"got {rows.dtype}")
    rows = rows.to(torch.int64).reshape(-1)
    if rows.numel() and (rows.min() < 0 or rows.max() >= N):
        raise ValueError(f"attention_probs: expected rows in [0, {N}), got {rows.tolist()}")
    rows = rows.to(device=qkv.device, dtype=torch.int64)
    lse = lse.contiguous()
    scale = head_dim**-0.5 if scale is None else float(scale)
    q, k, _ = _split_packed(qkv, num_heads)
    R = rows.numel()
    probs = _empty((B, num_heads, R, N), torch.float32, qkv.device)
    if R == 0:
        return probs
    precision = dot_input_precision(qkv.dtype)
    cfg = attention_config(N, head_dim, qkv.dtype, gpu_arch(qkv.device), precision).dq
    block_m = min(cfg.block_m, max(16, next_power_of_2(R)))
    launcher(_attention_probs_kernel, attention_grid(B * num_heads, R, block_m))(
        probs, q, k, lse, rows, *q.stride(), *k.stride(), num_heads, N, head_dim, R, scale,
        BLOCK_M=block_m, BLOCK_N=cfg.block_n, BLOCK_D=_block_d(head_dim),
        INPUT_PRECISION=precision, HEAD_ALIGN=_head_align(q, k), num_warps=cfg.num_warps)
    return probs


def attention_dropout_mask(seed: int | torch.Tensor, batch: int, num_heads: int, seq_len: int, dropout_p: float,
                           device="cpu") -> torch.Tensor:
    """Test helper: the bool keep mask (B, H, N, N) the kernels draw for ``seed`` (small sizes only); rate
    ``dropout_rate(dropout_p)``. Drawn in tiles of another shape than the training kernels' on purpose:
    the mask depends only on (seed, b * H + h, i, j)."""
    keep = _empty((batch * num_heads, seq_len, seq_len), torch.int8, torch.device(device))
    seed = torch.as_tensor(seed, dtype=torch.int64, device=device).reshape(1)
    block_m = 16
    launcher(_attention_dropout_mask_kernel, (cdiv(seq_len, block_m), batch * num_heads))(
        keep, seq_len, dropout_threshold(dropout_p), seed, BLOCK_M=block_m, BLOCK_N=32)
    return keep.view(batch, num_heads, seq_len, seq_len).bool()


# ---------------------------------------------------------------------------------------- reference
def attention_qkv_ref(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float | None = None,
                      dropout_p: float = 0.0, training: bool = False, dropout_mask: torch.Tensor | None = None):
    """Eager attention as timm computes it, in the inputs' dtype. ``dropout_mask`` (bool keep mask)
    replaces the random draw, so a test can hand the reference the kernel's exact mask."""
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    attn = ((q * scale) @ k.transpose(-2, -1)).softmax(dim=-1)
    rate = dropout_rate(dropout_p)  # the kernels' rate: p quantised to a multiple of 1/256
    if dropout_mask is not None:
        attn = attn * dropout_mask * (0.0 if rate >= 1.0 else 1.0 / (1.0 - rate))
    elif training and rate > 0.0:
        attn = torch.nn.functional.dropout(attn, rate)
    return attn @ v


def attention_ref(qkv: torch.Tensor, num_heads: int, scale: float | None = None, dropout_p: float = 0.0,
                  training: bool = False, dropout_mask: torch.Tensor | None = None) -> torch.Tensor:
    """Reference for ``attention``: timm's split of the packed qkv, eager attention, (B, N, H * D)."""
    B, N, width = qkv.shape
    q, k, v = qkv.reshape(B, N, 3, num_heads, width // (3 * num_heads)).permute(2, 0, 3, 1, 4).unbind(0)
    out = attention_qkv_ref(q, k, v, scale, dropout_p, training, dropout_mask)
    return out.transpose(1, 2).reshape(B, N, width // 3)


def attention_linear_ref(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, num_heads: int,
                         scale: float | None = None, dropout_p: float = 0.0, training: bool = False,
                         dropout_mask: torch.Tensor | None = None, query_rows: int | None = None) -> torch.Tensor:
    """Reference for ``attention_linear``: timm's qkv Linear, then ``attention_ref`` (its first query_rows)."""
    out = attention_ref(F.linear(x, weight, bias), num_heads, scale, dropout_p, training, dropout_mask)
    return out if query_rows is None else out[:, :query_rows]


# ------------------------------------------------------------------------------ ahead-of-time specs
_FLOAT_ARGS = ("scale", "inv_keep")


def _launch_values(tokens: int, num_heads: int, head_dim: int) -> dict[str, int]:
    """Integer arguments of a packed-layout launch (qkv (B, N, 3HD), out/dO (B, N, HD))."""
    N, H, D = tokens, num_heads, head_dim
    values = dict(num_heads=H, seq_len=N, q_len=N, head_dim=D, num_rows=1, stride_sm=stored_ds_row(N))
    for t in "qkvd":  # q, k, v and the packed gradient: (B, H, N, D) view of a (B, N, 3HD) tensor
        values.update({f"stride_{t}b": N * 3 * H * D, f"stride_{t}h": D, f"stride_{t}n": 3 * H * D, f"stride_{t}d": 1})
    for t in "og":  # out and dO: (B, H, N, D) view of a (B, N, HD) tensor
        values.update({f"stride_{t}b": N * H * D, f"stride_{t}h": D, f"stride_{t}n": H * D, f"stride_{t}d": 1})
    return values


def _aot_spec(name, fn, dtype, constexprs, tile, note, values, has_dot):
    """Type every argument of ``fn`` as a launch of the packed path types it: tensors in ``dtype``
    (lse/delta/probs/workspaces fp32, Rows i64), ints i32, floats fp32; unit strides become constexpr 1
    and multiples of 16 are listed in divisible_by_16, both as Triton specialises a real launch.
    head_dim is a constexpr; HEAD_ALIGN is what ``_head_align`` finds for the packed layout (its batch
    and head strides are multiples of D)."""
    head_align = next(a for a in (16, 8, 4, 2, 1) if values["head_dim"] % a == 0)
    constexprs = dict(constexprs, head_dim=values["head_dim"], HEAD_ALIGN=head_align,
                      **{a: 1 for a in fn.arg_names if values.get(a) == 1 and a.startswith("stride_")})
    width = values["num_heads"] * values["head_dim"]
    elem = torch.empty((), dtype=dtype).element_size()
    aligned = {a: width * elem % 16 == 0 for a in ("K", "V", "DK", "DV")}  # k, v inside qkv / dqkv
    pointer_types = dict(Lse="*fp32", Delta="*fp32", DQAcc="*fp32", P="*fp32", Rows="*i64", SEED="*i64")
    signature, divisible = {}, []
    for arg in fn.arg_names:
        if arg in constexprs:
            signature[arg] = "constexpr"
        elif arg[0].isupper():  # a pointer
            signature[arg] = pointer_types.get(arg, "*" + TRITON_DTYPE_NAMES[dtype])
            if aligned.get(arg, True):
                divisible.append(arg)
        elif arg in _FLOAT_ARGS:
            signature[arg] = "fp32"
        else:
            signature[arg] = "i32"
            if values.get(arg, 1) % 16 == 0:
                divisible.append(arg)
    return AotSpec(name=name, fn=fn, signature=signature, constexprs=constexprs, num_warps=tile.num_warps,
                   num_stages=tile.num_stages, has_dot=has_dot, note=note,
                   divisible_by_16=tuple(divisible))


def _short_aot_specs(tokens: int, D: int, dtype: torch.dtype, arch: int, values: dict) -> list[AotSpec]:
    """The short family's launches (the 'short' route), with and without dropout (where the head does not fit one
    program, the flash forward, listed with the flash family's specs)."""
    specs = []
    for dropout in (False, True):
        if not short_supported(tokens, D, dtype):
            continue
        cfg = short_config(tokens, D, dtype, arch, dropout)
        note = f"N={tokens} D={D} dropout={dropout}"
        common = dict(BLOCK_D=_block_d(D), DROPOUT=dropout, INPUT_PRECISION="ieee")
        if cfg.fwd is not None:
            note += f" segments={'+'.join(map(str, cfg.segments))}"
            specs.append(_aot_spec("attention_short_fwd", _attention_short_fwd_kernel, dtype,
                                   dict(common, BLOCK_M=cfg.fwd.block_m, **cfg.segment_constexprs("KEYS")),
                                   cfg.fwd, note, values, True))
        if cfg.dq_workspace:
            specs.append(_aot_spec("attention_short_bwd_streamed", _attention_short_bwd_streamed_kernel, dtype,
                                   dict(common, BLOCK_M=cfg.bwd.block_m, BLOCK_N=cfg.bwd.block_n), cfg.bwd,
                                   f"{note} keys held={cfg.bwd.block_n} q rows per step={cfg.bwd.block_m}", values,
                                   True))
        else:
            specs.append(_aot_spec("attention_short_bwd", _attention_short_bwd_kernel, dtype,
                                   dict(common, BLOCK_N=cfg.bwd.block_n, **cfg.segment_constexprs("ROWS")),
                                   cfg.bwd, f"{note} keys per step={cfg.bwd.block_n}", values, True))
    return specs


def aot_specs(tokens: int, width: int, num_heads: int, dtype: torch.dtype, arch: int, **_) -> list[AotSpec]:
    """Every launch the config table makes for one ViT attention layer: training with and without
    attention dropout, the attention-map kernel, and for fp32 both dot precisions (IEEE, the default,
    runs on FMA units, so only tf32 entries are expected to use tensor cores). The qkv bias's gradient is
    torch's column sum of d(qkv), no kernel of ours."""
    D = width // num_heads
    values = _launch_values(tokens, num_heads, D)
    specs = []
    for precision in ("ieee", "tf32") if dtype == torch.float32 else ("ieee",):
        tensor_cores = dtype != torch.float32 or precision == "tf32"
        stored_dq_tiles = set()  # the stored-dS dQ launch draws no mask: one spec per distinct tile
        for dropout in (False, True):
            cfg = attention_config(tokens, D, dtype, arch, precision, dropout)
            note = f"N={tokens} D={D} dropout={dropout}"
            common = lambda tile: dict(zip(("BLOCK_D", "BLOCK_D_TAIL"), _block_dims(D, tile.split)),  # noqa: E731
                                       DROPOUT=dropout, INPUT_PRECISION=precision, PEEL=tile.peel)
            specs.append(_aot_spec("attention_fwd", _attention_fwd_kernel, dtype,
                                   dict(common(cfg.fwd), BLOCK_M=cfg.fwd.block_m, BLOCK_N=cfg.fwd.block_n,
                                        TAIL_N=LAST_STEP), cfg.fwd,
                                   note, values, tensor_cores))
            bwd = dict(common(cfg.dq), BLOCK=cfg.dq.block_m, KV_BLOCK_M=cfg.dkdv.block_m, Q_BLOCK_N=cfg.dq.block_n,
                       TAIL=LAST_STEP)
            specs.append(_aot_spec("attention_bwd", _attention_bwd_kernel, dtype, bwd, cfg.dq,
                                   f"{note} dkdv={cfg.dkdv.block_n}x{cfg.dkdv.block_m} "
                                   f"dq={cfg.dq.block_m}x{cfg.dq.block_n}", values, tensor_cores))
            if tokens <= STORED_DS_MAX_TOKENS:  # the stored-dS backward, an autotuning candidate (StoredDsConfig)
                dkdv = dict(common(cfg.dkdv), BLOCK=cfg.dkdv.block_n, KV_BLOCK_M=cfg.dkdv.block_m, TAIL=LAST_STEP)
                specs.append(_aot_spec("attention_bwd_stored_ds_dkdv", _attention_bwd_dkdv_kernel, dtype, dkdv,
                                       cfg.dkdv, f"{note} {cfg.dkdv.block_n}x{cfg.dkdv.block_m}", values,
                                       tensor_cores))
                if cfg.dq not in stored_dq_tiles:
                    stored_dq_tiles.add(cfg.dq)
                    dq = dict(zip(("BLOCK_D", "BLOCK_D_TAIL"), _block_dims(D, cfg.dq.split)), BLOCK_M=cfg.dq.block_m,
                              BLOCK_N=cfg.dq.block_n, INPUT_PRECISION=precision, TAIL=LAST_STEP)
                    specs.append(_aot_spec("attention_bwd_stored_ds_dq", _attention_bwd_dq_stored_kernel, dtype, dq,
                                           cfg.dq, f"N={tokens} D={D} {cfg.dq.block_m}x{cfg.dq.block_n}", values,
                                           tensor_cores))
        specs += _short_aot_specs(tokens, D, dtype, arch, values)
        cfg = attention_config(tokens, D, dtype, arch, precision)
        specs.append(_aot_spec("attention_probs", _attention_probs_kernel, dtype,
                               dict(BLOCK_M=cfg.dq.block_m, BLOCK_N=cfg.dq.block_n, BLOCK_D=_block_d(D),
                                    INPUT_PRECISION=precision), cfg.dq,
                               f"N={tokens} D={D} attention maps", values, tensor_cores))
    return specs
