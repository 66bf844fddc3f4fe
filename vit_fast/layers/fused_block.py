"""A whole fused block as one autograd Function, for eager training where the host time per step counts.

``Block.forward_pair`` on the fused route runs five autograd pieces per block: the qkv GEMM (autograd's addmm and
autocast's weight copy), ``AttentionFunction``, the proj GEMM, ``AddLayerNormFunction`` twice and
``LinearActFunction``, each behind its public functional's checks. ``FusedBlockFunction`` runs the same custom ops
and GEMMs as one straight-line Function: what the parts' Functions do around their ops (rows views, saved tensors,
the parameter gradients' casts) is written out once, the two plain GEMMs and their weight casts run as eager
autograd would run them (the same mm calls, in the same layouts), and the checks run once per input signature
(``_checked``). Its outputs and gradients are bitwise those of ``forward_pair``'s per-part path
(tests/test_fused_block.py).

It runs where nothing needs the parts one by one: eager mode (torch.compile, FakeTensor and other dispatch modes
trace the custom ops of the per-part path), plain CUDA tensors (or CPU under the interpreter), the block's route
fully fused (flash or short attention kernels, ``linear_act`` MLP, fused joins), stock modules (no hooks, plain or
fusable Linears, LayerScale / DropPath or Identity, one train/eval mode), the stream in the GEMMs' dtype, every token
kept or the first ``keep_rows`` (the last block under class-token pooling); after it a LayerNorm
(``add_layer_norm``) or nothing (``bias_dropout_add``). ``eligible_plan`` says whether a call qualifies. Its backward
runs the parts autograd would run, no more (``_Needs``).
"""
from __future__ import annotations

from typing import NamedTuple, Optional

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils._python_dispatch import _get_current_dispatch_mode

from ..adapters import effective_bias, effective_weight, fusable_linear, parametrized
from ..kernels._join import stores_dx
from ..kernels._rows import as_rows
from ..kernels._utils import (
    cast_to,
    compute_dtype_for,
    direct_ops,
    env_switch,
    first_order_only,
    next_seed,
    op_caller,
    run_op,
    unit_stride,
)
from ..kernels.attention.interface import FAMILY_OPS, _dropout_and_seed
from ..kernels.bias_gelu import bias_dropout_add_bwd, bias_dropout_add_fwd, join_param_grads
from ..kernels.layer_norm import add_layer_norm_bwd, add_layer_norm_fwd, ln_param_grads
from ..kernels.linear_act import linear_act_bwd, linear_act_fwd
from .attention import Attention
from .common import dropout_rate
from .mlp import Mlp, act_is_stock
from .norm import LayerNorm


class BlockPlan(NamedTuple):
    """What stays fixed for one block and input signature: the parts' sizes, rates and kernel choices (a NamedTuple:
    built, hashed and compared on every call, in a fraction of a frozen dataclass's time)."""

    num_heads: int
    scale: float
    attention_kernel: str  # 'flash' | 'short'
    attn_p: float
    proj_p: float
    norm2_eps: float
    activation: str
    mlp_p: float
    next_eps: Optional[float]  # None: no LayerNorm after the block (its second join is ``bias_dropout_add``)
    keep_rows: Optional[int]  # the first tokens' output only (``Block.forward_pair``); None: every token's
    compute_dtype: torch.dtype
    autocast: bool  # the checks accept fp32 weights with 16-bit activations only under autocast
    training: bool


_PLAIN_TENSORS = (torch.Tensor, nn.Parameter)


class _Parts(NamedTuple):
    """The modules of a block that ``FusedBlockFunction`` reads."""

    attn: nn.Module
    mlp: nn.Module
    qkv: nn.Module
    proj: nn.Module
    fc1: nn.Module
    fc2: nn.Module
    norm2: nn.Module
    ls1: nn.Module
    ls2: nn.Module
    drop_path1: nn.Module
    drop_path2: nn.Module


def _parts(block) -> Optional[_Parts]:
    """The block's parts (None unless its attention and MLP are vit_fast's Attention and Mlp), read from the
    module dicts where every type on the way is a stock one (nothing can shadow a registered submodule there;
    nn.Module.__getattr__ costs about half a microsecond a read), by attribute otherwise (a linked transformers
    model's parts are descriptors)."""
    if type(block) is _block_types()[2]:
        modules = block._modules
        attn, mlp = modules["attn"], modules["mlp"]
        if type(attn) is Attention and type(mlp) is Mlp:
            attn_modules, mlp_modules = attn._modules, mlp._modules
            return _Parts(attn, mlp, attn_modules["qkv"], attn_modules["proj"], mlp_modules["fc1"], mlp_modules["fc2"],
                          modules["norm2"], modules["ls1"], modules["ls2"], modules["drop_path1"],
                          modules["drop_path2"])
    attn, mlp = block.attn, block.mlp
    if not (isinstance(attn, Attention) and isinstance(mlp, Mlp)):
        return None
    return _Parts(attn, mlp, attn.qkv, attn.proj, mlp.fc1, mlp.fc2, block.norm2, block.ls1, block.ls2,
                  block.drop_path1, block.drop_path2)


def _stock_parts(parts: _Parts) -> bool:
    """The block's parts are the stock modules ``FusedBlockFunction`` reproduces (subclasses that override none
    of the methods the per-part path calls pass: a linked transformers model's parts)."""
    layer_scale, drop_path, _ = _block_types()
    attn, mlp = parts.attn, parts.mlp
    return (_keeps_methods(type(attn), Attention, _ATTENTION_METHODS) and _keeps_methods(type(mlp), Mlp, _MLP_METHODS)
            and attn.fused_attn and not attn.has_qk_norm() and attn.attn_drop_rate() is not None
            and act_is_stock(mlp) and type(mlp.norm) is nn.Identity
            and joins_read(parts.ls1, layer_scale) and joins_read(parts.ls2, layer_scale)
            and joins_read(parts.drop_path1, drop_path) and joins_read(parts.drop_path2, drop_path)
            and fusable_linear(parts.qkv) and fusable_linear(parts.proj) and fusable_linear(parts.fc1)
            and fusable_linear(parts.fc2))


def _keeps_methods(cls: type, base: type, names: tuple) -> bool:
    """``cls`` (``base`` or a subclass) has ``base``'s methods ``names`` (asked per call: ``base`` itself answers at
    once)."""
    return cls is base or all(getattr(cls, name) is getattr(base, name) for name in names)


_ATTENTION_METHODS = ("branch", "fused", "kernel_family", "join_terms")
_MLP_METHODS = ("branch", "join_terms")


_types: tuple = ()


def joins_read(module: nn.Module, cls: type) -> bool:
    """The fused joins read ``module`` (an Identity, or ``cls``: LayerScale's gamma, DropPath's sample scale)
    rather than call it: ``cls`` itself or a subclass that keeps its forward (a linked model's part); a module of
    another class (timm's LayerScale), or one with its own forward, is called."""
    kind = type(module)
    return kind is nn.Identity or kind is cls or (isinstance(module, cls) and kind.forward is cls.forward
                                                  and not parametrized(module))


def register_block_types(layer_scale: type, drop_path: type, block: type) -> None:
    """block.py's classes (it imports this module), handed over once it defines them: filled at import, never
    while a region is traced (dynamo refuses a global written inside a checkpointed region)."""
    global _types
    _types = (layer_scale, drop_path, block)


def _block_types() -> tuple:
    """(LayerScale, DropPath, Block)."""
    return _types


# The switch: VIT_FAST_BLOCK_FUNCTION=0 (or false / off / no) at import, or ``fused_block.enabled = False``, runs
# every block per part (an A/B of the host work on a GPU; the same numbers either way).
enabled = env_switch("VIT_FAST_BLOCK_FUNCTION")


def eligible_plan(block, parts: _Parts, hidden: torch.Tensor, residual: torch.Tensor,
                  next_norm: Optional[nn.Module], keep_rows: Optional[int]) -> Optional[BlockPlan]:
    """The plan of ``block`` for this call (the block itself resolved to the Triton backend), or None where the
    per-part path must run (module docstring)."""
    if (not enabled or torch.compiler.is_compiling()
            or _get_current_dispatch_mode() is not None or block.join_impl != "fused"):
        return None
    if keep_rows is not None and type(keep_rows) is not int:  # True, 1.0, numpy ints equal (and hash as) 1 in the
        return None  # signature: the per-part path's check (``attention_linear``'s query_rows) refuses them
    for t in (hidden, residual):
        if type(t) not in _PLAIN_TENSORS or t.device.type not in ("cuda", "cpu"):
            return None
    attn, mlp = parts.attn, parts.mlp
    if (attn.impl not in ("fused", "short") or mlp.impl != "fused" or attn.backend != block.backend
            or mlp.backend != block.backend):
        return None
    training = block.training
    proj_p, mlp_p = dropout_rate(attn.proj_drop), dropout_rate(mlp.drop2)
    if (dropout_rate(mlp.drop1) != 0 or proj_p is None or mlp_p is None or not _stock_parts(parts)
            or attn.training != training or mlp.training != training or parts.drop_path1.training != training
            or parts.drop_path2.training != training):
        return None
    dtype = compute_dtype_for(hidden)
    if hidden.dtype != dtype:  # the qkv GEMM's input as the fused chain hands it over (autocast would cast it)
        return None
    return BlockPlan(num_heads=attn.num_heads, scale=attn.scale,
                     attention_kernel=attn.kernel_family(hidden.shape[1], dtype), attn_p=attn.attn_drop_rate(),
                     proj_p=proj_p, norm2_eps=parts.norm2.eps, activation=mlp.act_name,
                     mlp_p=mlp_p, next_eps=None if next_norm is None else next_norm.eps, keep_rows=keep_rows,
                     compute_dtype=dtype,
                     autocast=torch.is_autocast_enabled(hidden.device.type), training=training)


def _sample_scale(drop_path: nn.Module, like: torch.Tensor) -> Optional[torch.Tensor]:
    return drop_path.sample_scale(like) if isinstance(drop_path, _block_types()[1]) else None


def _gamma(layer_scale: nn.Module) -> Optional[torch.Tensor]:
    return _param(layer_scale, "gamma") if isinstance(layer_scale, _block_types()[0]) else None


def _param(module: nn.Module, name: str) -> Optional[torch.Tensor]:
    """``getattr(module, name)`` for a stock module's parameter, from its parameter dict where it is registered
    there (a DataParallel replica keeps its parameters as plain attributes)."""
    parameters = module._parameters
    return parameters[name] if name in parameters else getattr(module, name)


def _weight_and_bias(module: nn.Module) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
    """A fusable Linear's (or a LayerNorm's) weight and bias."""
    if type(module) in _STOCK_AFFINE:
        return _param(module, "weight"), _param(module, "bias")
    if isinstance(module, nn.LayerNorm):
        return module.weight, module.bias
    return effective_weight(module), effective_bias(module)


_STOCK_AFFINE = (nn.Linear, nn.LayerNorm, LayerNorm)


# Signatures the per-part path has run (its functionals checked every input then): the input shapes, strides,
# dtypes and devices, the parameters' shapes and dtypes and the plan (rates, eps, autocast's dtype).
_checked: set = set()


def plan_for(block, hidden: torch.Tensor, residual: torch.Tensor, next_norm: Optional[nn.Module],
             keep_rows: Optional[int]) -> tuple[Optional[BlockPlan], Optional[_Parts], tuple, tuple]:
    """(plan, parts, params, signature) of this call; plan None where the per-part path must run. ``ready(signature)``:
    the per-part path has run it, so its checks hold; until then the caller runs the per-part path and then
    calls ``mark_checked(signature)``."""
    parts = _parts(block) if enabled else None
    plan = None if parts is None else eligible_plan(block, parts, hidden, residual, next_norm, keep_rows)
    if plan is None:
        return None, None, (), ()
    params = _params(parts, next_norm)
    # the inputs' shapes, strides, dtypes and devices, the parameters' shapes, dtypes and devices (None where absent)
    return plan, parts, params, (plan, hidden.shape, hidden.stride(), hidden.dtype, hidden.device, residual.shape,
                                 residual.stride(), residual.dtype, residual.device,
                                 *[None if p is None else (p.shape, p.dtype, p.device) for p in params])


def ready(signature: tuple) -> bool:
    """The per-part path has run ``signature`` (its functionals checked every input then)."""
    return signature in _checked


def saved_tensor_hooks_on() -> bool:
    """Saved-tensor hooks are on: torch.utils.checkpoint (its forward and its recomputation) or save_on_cpu."""
    return torch._C._autograd._top_saved_tensors_default_hooks(False) is not None


def mark_checked(signature: tuple) -> None:
    """``signature`` ran per part (its functionals checked it): its next calls may run as one Function. Safe under
    torch.utils.checkpoint, whose recomputation must take its forward's path: a checkpointed block either had the
    path decided before the checkpoint (``Block.runs_as_one_function``) or ran per part under the hooks, and does
    again when recomputed."""
    if len(_checked) >= _MAX_CHECKED:  # shapes that keep changing: check again rather than grow without end
        _checked.clear()
    _checked.add(signature)


_MAX_CHECKED = 4096


def _params(parts: _Parts, next_norm: Optional[nn.LayerNorm]) -> tuple:
    """The 14 parameters ``FusedBlockFunction`` reads (None where a part has none)."""
    return (*_weight_and_bias(parts.qkv), *_weight_and_bias(parts.proj), *_weight_and_bias(parts.norm2),
            _gamma(parts.ls1), *_weight_and_bias(parts.fc1), *_weight_and_bias(parts.fc2),
            *((None, None) if next_norm is None else _weight_and_bias(next_norm)), _gamma(parts.ls2))


def run_block(plan: BlockPlan, parts: _Parts, params: tuple, hidden: torch.Tensor,
              residual: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``block.forward_pair(hidden, residual, next_norm)`` as one Function, for a checked signature (``parts`` and
    ``params`` from ``plan_for``). The random draws come in the per-part path's order: attention's seed,
    drop-path 1, join 1's seed, drop-path 2, join 2's seed."""
    device = hidden.device
    _, attn_seed = _dropout_and_seed(plan.attn_p, plan.training, device)
    scale1 = _sample_scale(parts.drop_path1, hidden)
    join1_p, join1_seed = _join_dropout(plan.proj_p, device)
    scale2 = _sample_scale(parts.drop_path2, hidden)
    join2_p, join2_seed = _join_dropout(plan.mlp_p, device)
    qkv_w, qkv_b, proj_w, *rest = params  # the qkv and proj GEMMs read their parameters as they are
    return FusedBlockFunction.apply(plan, torch.is_grad_enabled(), hidden, residual, qkv_w, qkv_b, proj_w,
                                    *map(unit_stride, rest), scale1, scale2, attn_seed, join1_seed, join2_seed,
                                    join1_p, join2_p)


def _join_dropout(p: float, device: torch.device) -> tuple[float, Optional[torch.Tensor]]:
    """``prepare_join``'s dropout choice for the rate the dropout module applies now (its checks ran on the per-part
    path)."""
    p = float(p)
    return p, (next_seed(device) if p > 0 else None)


def _linear_backward(grad: torch.Tensor, input: Optional[torch.Tensor], weight: torch.Tensor, needs_input: bool,
                     needs_weight: bool) -> tuple[Optional[torch.Tensor], Optional[torch.Tensor]]:
    """The gradients eager autograd's mm backward computes for ``F.linear(input, weight)`` on rows (input (..., K)
    contiguous; only read for d(weight)), in its layouts: d(input) = grad @ weight; d(weight) = grad^T @ input for
    a row-major weight, (input^T @ grad)^T for a column-major one."""
    grad2 = grad.reshape(-1, grad.shape[-1])
    d_input = grad2.mm(weight).view(*grad.shape[:-1], weight.shape[1]) if needs_input else None
    if not needs_weight:
        return d_input, None
    input2 = input.reshape(-1, input.shape[-1])
    row_major = weight.stride(1) == 1 and weight.stride(0) == weight.shape[1]  # mm_mat2_backward's test
    return d_input, (grad2.t().mm(input2) if row_major else input2.t().mm(grad2).t())


class _Needs(NamedTuple):
    """Which parts of the block's backward run (autograd would run a part's node only when an input of it needs a
    gradient), from the Function's ``needs_input_grad`` and the grad mode at the call."""

    attention: bool  # hidden, the qkv weight or bias: the attention backward and the proj GEMM's dgrad
    proj_weight: bool
    join1: bool  # anything before the MLP
    mlp: bool  # the MLP's input or parameters

    @staticmethod
    def of(needs: tuple[bool, ...]) -> "_Needs":
        join1 = any(needs[2:11])
        return _Needs(needs[2] or needs[4] or needs[5], needs[6], join1, join1 or any(needs[11:14]))


_NO_GRADS = (False,) * 25


class FusedBlockFunction(torch.autograd.Function):
    """(normed, residual') = ``Block.forward_pair(hidden, residual, next_norm)`` in one node (module docstring).
    Inputs after the plan and the grad mode of the call: hidden, residual, the 14 parameters of ``_params`` (None
    where absent), the two drop-path scales, three seeds and the joins' dropout rates.

    Straight-line: the parts' custom ops (``op_caller``: their Python functions directly on plain tensors, the ops
    themselves where something traces) with what the parts' autograd Functions do around them (rows views, the
    saved tensors, the parameter gradients' casts) written out once here, in their order and layouts."""

    @staticmethod
    def forward(ctx, plan: BlockPlan, grad: bool, hidden, residual, qkv_w, qkv_b, proj_w, proj_b, n2_w, n2_b, gamma1,
                fc1_w, fc1_b, fc2_w, fc2_b, next_w, next_b, gamma2, scale1, scale2, attn_seed, join1_seed, join2_seed,
                join1_p, join2_p):
        ctx.set_materialize_grads(False)
        needs = ctx.needs_input_grad if grad else _NO_GRADS  # set from requires_grad, also under no_grad
        wants = _Needs.of(needs)
        dtype = plan.compute_dtype
        attention_fwd, ctx.attention_bwd = FAMILY_OPS[plan.attention_kernel]
        attn_p = plan.attn_p if plan.training else 0.0
        with direct_ops():
            run_op = op_caller()
            # attention: the qkv GEMM with its bias as a constant (its gradient comes from the attention backward)
            qkv_wc = cast_to(qkv_w, dtype)  # autocast's weight copy (the weight itself when it has the dtype)
            qkv = F.linear(hidden, qkv_wc, qkv_b)
            # ``keep_rows``: attention's first queries only (every token a key and value), the rest on those rows
            keep = plan.keep_rows
            out, lse = run_op(attention_fwd, qkv, plan.num_heads, float(plan.scale), attn_p, attn_seed,
                              qkv.shape[1] if keep is None else keep)
            proj_wc = cast_to(proj_w, dtype)
            branch = F.linear(out, proj_wc)
            shape = branch.shape
            width = shape[-1]
            branch2 = as_rows(branch, width)
            residual_kept = residual if keep is None else residual[:, :keep]
            normed2, stream2, mean1, rstd1 = run_op(add_layer_norm_fwd, branch2, as_rows(residual_kept, width), n2_w,
                                                    n2_b, proj_b, gamma1, scale1, float(plan.norm2_eps), join1_p,
                                                    join1_seed, None)
            # the MLP (``linear_act``): weights in the GEMMs' dtype with unit column stride
            fc1_wc, fc2_wc = cast_to(fc1_w, dtype), cast_to(fc2_w, dtype)
            fc1_wc = fc1_wc if fc1_wc.stride(-1) == 1 else fc1_wc.contiguous()
            fc2_wc = fc2_wc if fc2_wc.stride(-1) == 1 else fc2_wc.contiguous()
            mlp_in = cast_to(normed2, dtype)
            needs_du = wants.join1 or needs[11] or needs[12]
            hid, dact = run_op(linear_act_fwd, mlp_in, fc1_wc, fc1_b, plan.activation, needs_du)
            y = F.linear(hid, fc2_wc)
            if plan.next_eps is None:
                normed_out = None
                stream_out = run_op(bias_dropout_add_fwd, y.view(shape), fc2_b, stream2.view(shape), gamma2, scale2,
                                    join2_p, join2_seed)
                join2 = (None, y, None, None, fc2_b, gamma2, scale2, None, None, join2_seed)
                join2_h_dtype = stream_out.dtype
            else:
                normed_o, stream_o, mean2, rstd2 = run_op(add_layer_norm_fwd, y, stream2, next_w, next_b, fc2_b,
                                                          gamma2, scale2, float(plan.next_eps), join2_p, join2_seed,
                                                          None)
                normed_out, stream_out = normed_o.view(shape), stream_o.view(shape)
                join2 = (stream_o, y, next_w, next_b, fc2_b, gamma2, scale2, mean2, rstd2, join2_seed)
                join2_h_dtype = stream_o.dtype
        # saved: what the backward parts that will run read (as autograd keeps only its live nodes' tensors)
        ctx.save_for_backward(
            *((qkv, qkv_b if needs[5] else None, lse, attn_seed, hidden, qkv_wc) if wants.attention else (None,) * 6),
            *((proj_wc, out) if wants.attention or wants.proj_weight else (None, None)),
            *((stream2, branch2, n2_w, n2_b, proj_b, gamma1, scale1, mean1, rstd1, join1_seed) if wants.join1
              else (None,) * 10),
            *((mlp_in, fc1_wc, fc1_b, fc2_wc, hid, dact) if wants.mlp else (None,) * 6), *join2)
        ctx.plan, ctx.needs, ctx.wants, ctx.shape = plan, needs, wants, shape
        ctx.needs_du = needs_du
        ctx.weight_dtypes = (qkv_w.dtype, proj_w.dtype, fc1_w.dtype, fc2_w.dtype)
        # dx written by a join's backward unless it is the incoming gradient; the streams' dtypes its d(residual)
        ctx.store_dx1 = stores_dx(join1_p, gamma1, scale1, stream2.dtype, branch2.dtype)
        ctx.store_dx2 = stores_dx(join2_p, gamma2, scale2, join2_h_dtype, y.dtype)
        ctx.stream_dtypes = (residual.dtype, stream2.dtype)  # the joins' residuals'
        ctx.residual_shape = residual.shape  # d(residual) of every token (zeros past ``keep_rows``, as a slice's)
        ctx.rates = (attn_p, join1_p, join2_p)
        return normed_out, stream_out

    @staticmethod
    @first_order_only  # a gradient under create_graph=True raises: no second derivative
    def backward(ctx, d_normed, d_stream):
        saved = ctx.saved_tensors  # unpacked first: a checkpointed region recomputes here, with every check on
        if torch.compiler.is_compiling():  # compiled autograd traces the parts' custom ops
            return FusedBlockFunction._backward(ctx, saved, d_normed, d_stream, run_op)
        with direct_ops():
            return FusedBlockFunction._backward(ctx, saved, d_normed, d_stream, op_caller())

    @staticmethod
    def _backward(ctx, saved, d_normed, d_stream, run_op):
        (qkv, qkv_bias, lse, attn_seed, hidden, qkv_wc, proj_wc, out,
         stream1, branch1, n2_w, n2_b, proj_b, gamma1, scale1, mean1, rstd1, seed1,
         mlp_in, fc1_wc, fc1_b, fc2_wc, hid, dact,
         stream2, y, next_w, next_b, fc2_b, gamma2, scale2, mean2, rstd2, seed2) = saved
        plan, needs, wants, shape = ctx.plan, ctx.needs, ctx.wants, ctx.shape
        width = shape[-1]
        attn_p, p1, p2 = ctx.rates
        residual1_dtype, residual2_dtype = ctx.stream_dtypes
        qkv_dtype, proj_dtype, fc1_dtype, fc2_dtype = ctx.weight_dtypes
        grads = [None] * 25
        if plan.next_eps is not None:
            dy, d_stream1, grads[15], grads[16], grads[17], grads[14] = _join_backward(
                run_op, d_normed, d_stream, shape, stream2, y, next_w, next_b, fc2_b, gamma2, scale2, mean2, rstd2,
                p2, seed2, ctx.store_dx2, residual2_dtype)
        elif d_stream is None:  # the stream, the only output, unused
            return (None,) * 25
        else:
            dx, dparams = run_op(bias_dropout_add_bwd, as_rows(d_stream, width), y, fc2_b, gamma2, scale2, p2, seed2)
            dy = dx.view(shape) if ctx.store_dx2 else d_stream
            grads[14], grads[17] = join_param_grads(dparams, fc2_b, gamma2)
            d_stream1 = cast_to(d_stream, residual2_dtype)
        if wants.mlp:
            dy2 = cast_to(as_rows(dy, width), hid.dtype)
            if needs[13]:
                grads[13] = cast_to(dy2.t().mm(hid), fc2_dtype)  # cuBLAS
            if ctx.needs_du:
                needs_db = fc1_b is not None and needs[12]
                du, db = run_op(linear_act_bwd, dy2, dact, fc2_wc, fc1_b if needs_db else None)
                grads[12] = db if needs_db else None
                if wants.join1:
                    d_normed1 = du.mm(fc1_wc).view(shape)  # cuBLAS
                if needs[11]:
                    grads[11] = cast_to(du.t().mm(mlp_in), fc1_dtype)  # cuBLAS
        if wants.join1:
            d_branch, grads[3], grads[8], grads[9], grads[10], grads[7] = _join_backward(
                run_op, d_normed1, d_stream1, shape, stream1, branch1, n2_w, n2_b, proj_b, gamma1, scale1, mean1,
                rstd1, p1, seed1, ctx.store_dx1, residual1_dtype)
            if plan.keep_rows is not None:  # autograd's slice backward: zeros, the kept rows copied in
                kept, grads[3] = grads[3], (grads[3].new_zeros(ctx.residual_shape) if needs[3] else None)
                if needs[3]:
                    grads[3][:, :kept.shape[1]] = kept
            d_out, d_proj_w = _linear_backward(d_branch, out, proj_wc, wants.attention, needs[6])
            grads[6] = cast_to(d_proj_w, proj_dtype)
            if wants.attention:
                d_qkv, dbias = run_op(ctx.attention_bwd, d_out, qkv, qkv_bias, out, lse, plan.num_heads,
                                      float(plan.scale), attn_p, attn_seed)
                grads[5] = dbias if qkv_bias is not None else None
                grads[2], d_qkv_w = _linear_backward(d_qkv, hidden, qkv_wc, needs[2], needs[4])
                grads[4] = cast_to(d_qkv_w, qkv_dtype)
        return tuple(grads)


def _join_backward(run_op, dy, dh_out, shape, h, x, weight, bias, branch_bias, gamma, sample_scale, mean, rstd, p, seed,
                   store_dx, residual_dtype):
    """``AddLayerNormFunction.backward`` of a join with a residual (h, x: its saved rows): (dx, d(residual),
    dweight, dbias, dgamma, dbranch_bias)."""
    width = shape[-1]
    dh_out2 = as_rows(dh_out, width) if dh_out is not None else None
    if dy is None:  # normed unused: only the join's backward (no LN pass over zeros)
        dx, dparams = run_op(bias_dropout_add_bwd, dh_out2, x, branch_bias, gamma, sample_scale, p, seed)
        dh = dh_out2.view(shape)
        dbranch, dgamma = join_param_grads(dparams, branch_bias, gamma)
        return (dx.view(shape) if store_dx else dh), cast_to(dh, residual_dtype), None, None, dgamma, dbranch
    dh, dx, dparams = run_op(add_layer_norm_bwd, as_rows(dy, width), dh_out2, h, x, weight, bias, branch_bias, gamma,
                             sample_scale, mean, rstd, p, seed, store_dx)
    dh = dh.view(shape)
    dweight, dbias, dgamma, dbranch = ln_param_grads(dparams, weight, bias, gamma, branch_bias)
    return (dx.view(shape) if store_dx else dh), cast_to(dh, residual_dtype), dweight, dbias, dgamma, dbranch

