"""``vit-fast check``: are the fused kernels right on this machine?

Every kernel's forward output and every input gradient (layer_norm, add_layer_norm, bias_gelu,
linear_act, bias_dropout_add, attention, patch_embed), then the whole model's logits and parameter gradients with
backend 'triton', are compared on random inputs with the same computation in float64 (the ``_ref``
functions / the model on backend 'torch'). One table: op, shape, dtype, max abs error, relative error
||out - ref|| / ||ref||, its bound (rel. bound), PASS/FAIL; exit status 1 on any failure.

Bounds (CONTRIBUTING.md 4, vit_fast.tools.numerics): fp32 1e-6 elementwise / 1e-5 with a dot (TF32 is switched off
for the check); fp16 1e-3; bf16 1e-2. In fp16/bf16 a kernel must also stay within 2x the error of eager
PyTorch in the same dtype (+ a small slack), so the bound printed is the smaller of the two. The model
rows use the 2x-eager rule alone, floored at the per-op bound: rounding errors grow with depth for eager
and fused alike. NaN never passes.

On CUDA the kernels run compiled at the requested size. Without CUDA they run in the Triton interpreter
(TRITON_INTERPRET=1; the command re-executes itself with it set) on a reduced model (2 blocks, a 2x2 patch
grid, batch 2 unless given) so the check finishes in about a minute on two cores; the output says so.
"""
from __future__ import annotations

import argparse
import contextlib
import copy
import os
import re
import sys
import time
from dataclasses import dataclass
from typing import Callable, Optional, Sequence

import torch

DTYPES = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}
OPS = ("layer_norm", "add_layer_norm", "bias_gelu", "linear_act", "bias_dropout_add", "attention", "patch_embed",
       "model")
CPU_DEPTH = 2


@dataclass
class Row:
    op: str
    shape: tuple
    dtype: torch.dtype
    max_abs: float
    rel: float
    bound: float

    @property
    def ok(self) -> bool:
        return self.rel <= self.bound  # False for NaN


def measure(op: str, out: torch.Tensor, ref64: torch.Tensor, eager: Optional[torch.Tensor], kind: str,
            model_rule: bool = False, compute_dtype: Optional[torch.dtype] = None) -> Row:
    """Row for one tensor: error of ``out`` against the float64 ``ref64``; ``eager`` (the same computation
    in out's dtype, or None in fp32) sets the 2x-eager part of the bound. ``compute_dtype``: the dtype the
    bound is for when it differs from out's (the fp32 gradient of an fp32 bias in a bf16 computation)."""
    from .numerics import EAGER_SLACK, bound, errors

    dtype = compute_dtype or out.dtype
    rel, max_abs = errors(out, ref64)
    if bool(torch.isnan(out).any()) and not bool(torch.isnan(ref64).any()):
        rel = max_abs = float("nan")
    limit = bound(dtype, kind)
    if eager is not None and dtype != torch.float32:
        two_x = 2 * errors(eager, ref64)[0] + EAGER_SLACK[dtype]
        limit = max(limit, two_x) if model_rule else min(limit, two_x)
    return Row(op, tuple(out.shape), out.dtype, max_abs, rel, limit)


def run_op(fn: Callable, inputs: dict[str, torch.Tensor], grad_names: Sequence[str], grad_outs: Sequence[torch.Tensor]):
    """Outputs (tuple) and the gradients of ``grad_names`` after backward of sum(out_i * grad_out_i)."""
    leaves = {k: (v.detach().clone().requires_grad_(k in grad_names) if isinstance(v, torch.Tensor) else v)
              for k, v in inputs.items()}
    outs = fn(**leaves)
    outs = outs if isinstance(outs, tuple) else (outs,)
    torch.autograd.backward(list(outs), [g.to(o.dtype) for o, g in zip(outs, grad_outs)])
    return [o.detach() for o in outs], [leaves[k].grad for k in grad_names]


def check_op(op: str, fn: Callable, ref_fn: Callable, inputs: dict, grad_names: Sequence[str], out_names: Sequence[str],
             out_shapes: Sequence[tuple], kind: str, dtype: torch.dtype, generator: torch.Generator) -> list[Row]:
    """Kernel vs float64 reference (vs eager in dtype for the bound), forward and every gradient."""
    device = next(v.device for v in inputs.values() if isinstance(v, torch.Tensor))
    grad_outs = [torch.randn(s, generator=generator, dtype=torch.float64).to(device) for s in out_shapes]
    as64 = {k: v.double() if isinstance(v, torch.Tensor) and v.is_floating_point() and v.dtype == dtype else v
            for k, v in inputs.items()}
    outs, grads = run_op(fn, inputs, grad_names, grad_outs)
    refs, ref_grads = run_op(ref_fn, as64, grad_names, grad_outs)
    eager_outs, eager_grads = (run_op(ref_fn, inputs, grad_names, grad_outs) if dtype != torch.float32
                               else ([None] * len(outs), [None] * len(grads)))
    rows = [measure(f"{op} {name}", o, r, e, kind, compute_dtype=dtype)
            for name, o, r, e in zip(out_names, outs, refs, eager_outs)]
    rows += [measure(f"{op} d{name}", g, r, e, kind, compute_dtype=dtype)
             for name, g, r, e in zip(grad_names, grads, ref_grads, eager_grads)]
    return rows


def kernel_rows(cfg, batch: int, dtype: torch.dtype, device: torch.device, ops: Sequence[str], seed: int) -> list[Row]:
    from ..kernels import attention as A
    from ..kernels import bias_gelu as G
    from ..kernels import layer_norm as L
    from ..kernels import linear_act as LA
    from ..kernels import patch_embed as P
    from ..kernels.attention import interface as attention_host

    g = torch.Generator().manual_seed(seed)

    def rand(*shape, scale=1.0, offset=0.0, dt=dtype):
        return (torch.randn(shape, generator=g, dtype=torch.float64) * scale + offset).to(device=device, dtype=dt)

    B, N, D, F, H = batch, cfg.num_tokens, cfg.embed_dim, cfg.mlp_hidden, cfg.num_heads
    eps = cfg.norm_eps
    rows: list[Row] = []
    if "layer_norm" in ops:
        inputs = dict(x=rand(B, N, D), weight=rand(D, scale=0.1, offset=1.0), bias=rand(D, scale=0.1), eps=eps)
        rows += check_op("layer_norm", lambda **a: L.layer_norm(**a), L.layer_norm_ref, inputs,
                         ["x", "weight", "bias"], ["out"], [(B, N, D)], "elementwise", dtype, g)
    if "add_layer_norm" in ops:
        inputs = dict(x=rand(B, N, D), residual=rand(B, N, D), weight=rand(D, scale=0.1, offset=1.0),
                      bias=rand(D, scale=0.1), eps=eps, branch_bias=rand(D, scale=0.1), gamma=rand(D, scale=0.1))
        rows += check_op("add_layer_norm", lambda **a: L.add_layer_norm(**a), L.add_layer_norm_ref, inputs,
                         ["x", "residual", "weight", "bias", "branch_bias", "gamma"], ["out", "h"],
                         [(B, N, D)] * 2, "elementwise", dtype, g)
    if "bias_gelu" in ops:
        approximate = "tanh" if cfg.act == "gelu_tanh" else "none"
        inputs = dict(x=rand(B, N, F), bias=rand(F, scale=0.1), approximate=approximate)
        rows += check_op("bias_gelu", lambda **a: G.bias_gelu(**a), G.bias_gelu_ref, inputs, ["x", "bias"],
                         ["out"], [(B, N, F)], "elementwise", dtype, g)
    if "linear_act" in ops:
        inputs = dict(x=rand(B, N, D), w1=rand(F, D, scale=D ** -0.5), b1=rand(F, scale=0.1),
                      w2=rand(D, F, scale=F ** -0.5), activation=cfg.act)
        rows += check_op("linear_act", lambda **a: LA.linear_act(**a), LA.linear_act_ref, inputs,
                         ["x", "w1", "b1", "w2"], ["out"], [(B, N, D)], "dot", dtype, g)
        if dtype != torch.float32 and (device.type != "cuda" or LA.gpu_arch(device) >= 90):
            with LA.tma_only():  # the persistent TMA kernels (sm_90's 16-bit default)
                rows += check_op("linear_act_tma", lambda **a: LA.linear_act(**a), LA.linear_act_ref, inputs,
                                 ["x", "w1", "b1", "w2"], ["out"], [(B, N, D)], "dot", dtype, g)
    if "bias_dropout_add" in ops:  # dropout off: a random mask has no deterministic reference
        inputs = dict(x=rand(B, N, D), bias=rand(D, scale=0.1), residual=rand(B, N, D), p=0.0, training=False,
                      gamma=rand(D, scale=0.1))
        rows += check_op("bias_dropout_add", lambda **a: G.bias_dropout_add(**a), G.bias_dropout_add_ref, inputs,
                         ["x", "bias", "residual", "gamma"], ["out"], [(B, N, D)], "elementwise", dtype, g)
    if "attention" in ops:
        inputs = dict(qkv=rand(B, N, 3 * D), num_heads=H)
        rows += check_op("attention", lambda **a: A.attention(**a), A.attention_ref, inputs, ["qkv"], ["out"],
                         [(B, N, D)], "dot", dtype, g)
        if A.short_supported(N, D // H, dtype):  # the short-sequence family, where it runs
            rows += check_op("attention_short", lambda **a: A.attention(**a, kernel="short"), A.attention_ref,
                             dict(qkv=rand(B, N, 3 * D), num_heads=H), ["qkv"], ["out"], [(B, N, D)], "dot", dtype, g)
        # as the model calls it: the qkv Linear (bias in its GEMM, the bias's gradient from the attention
        # backward); in 16 bits under autocast, with fp32 weight and bias (fp32 gradients from fp32 partials)
        inputs = dict(x=rand(B, N, D), weight=rand(3 * D, D, scale=D ** -0.5, dt=torch.float32),
                      bias=rand(3 * D, scale=0.5, dt=torch.float32), num_heads=H)

        def attention_linear_amp(x, weight, bias, num_heads):
            with torch.autocast(x.device.type, dtype=dtype, enabled=dtype != torch.float32):
                return A.attention_linear(x, weight, bias, num_heads)

        def attention_linear_cast_ref(x, weight, bias, num_heads):  # autocast's casts by hand (float64 stays float64)
            return A.attention_linear_ref(x, weight.to(x.dtype), bias.to(x.dtype), num_heads)

        rows += check_op("attention_linear", attention_linear_amp, attention_linear_cast_ref, inputs,
                         ["x", "weight", "bias"], ["out"], [(B, N, D)], "dot", dtype, g)
        with attention_host.stored_ds_only():  # the backward with dS stored, a candidate the autotuner may pick
            rows += check_op("attention_linear_stored_ds", attention_linear_amp, attention_linear_cast_ref, inputs,
                             ["x", "weight", "bias"], ["out"], [(B, N, D)], "dot", dtype, g)
    if "patch_embed" in ops:
        (h, w), p, C = cfg.img_size, cfg.patch_size[0], cfg.in_chans
        prefix = cfg.num_prefix_tokens
        inputs = dict(images=rand(B, C, h, w), weight=rand(D, C, p, p, scale=(C * p * p) ** -0.5),
                      bias=rand(D, scale=0.1), pos_embed=rand(1, N if not cfg.no_embed_class else N - prefix, D,
                                                              scale=0.1),
                      cls_token=rand(1, 1, D, scale=0.1) if cfg.class_token else None,
                      reg_tokens=rand(1, cfg.reg_tokens, D, scale=0.1) if cfg.reg_tokens else None,
                      pos_embed_covers_prefix=not cfg.no_embed_class)
        grads = ["images", "weight", "bias", "pos_embed"] + [k for k in ("cls_token", "reg_tokens")
                                                              if inputs[k] is not None]
        rows += check_op("patch_embed", lambda **a: P.patch_embed(**a), P.patch_embed_ref, inputs, grads, ["out"],
                         [(B, N, D)], "dot", dtype, g)
        if dtype != torch.float32:  # fp32 tokens from the 16-bit GEMM: the model's residual stream under autocast
            rows += check_op("patch_embed_fp32_tokens", lambda **a: P.patch_embed(**a, tokens_dtype=torch.float32),
                             _wide_tokens_ref, inputs, grads, ["out"], [(B, N, D)], "dot", dtype, g)
        if dtype != torch.float32:  # the dW GEMM on cuBLAS, a candidate the autotuner may pick
            with P.library_dweight_only():
                rows += check_op("patch_embed_cublas_dw", lambda **a: P.patch_embed(**a), P.patch_embed_ref, inputs,
                                 grads, ["out"], [(B, N, D)], "dot", dtype, g)
    return rows


def _wide_tokens_ref(**inputs):
    """patch_embed_ref with fp32 tokens from 16-bit inputs (eager in the check's dtype), float64 ones in float64."""
    from ..kernels.patch_embed import patch_embed_ref

    wide = inputs["images"].dtype != torch.float64
    return patch_embed_ref(**inputs, tokens_dtype=torch.float32 if wide else None)


@torch.no_grad()
def _perturb_(model: torch.nn.Module, generator: torch.Generator) -> None:
    """Random weights everywhere (init leaves biases 0 and norm weights 1, which would hide a bug)."""
    for p in model.parameters():
        p.add_(torch.randn(p.shape, generator=generator, dtype=torch.float64).to(p) * 0.05)


def model_rows(model: torch.nn.Module, batch: int, dtype: torch.dtype, device: torch.device, seed: int) -> list[Row]:
    """Logits and parameter gradients of the model on backend 'triton' in dtype vs the reference model in
    float64; gradients grouped over blocks (blocks.*.name: the worst block shown)."""
    g = torch.Generator().manual_seed(seed + 1)
    _perturb_(model, g)
    cfg = model.config
    images = torch.randn(batch, cfg.in_chans, *cfg.img_size, generator=g, dtype=torch.float64)
    weight_seed = seed + 2

    def run(backend: str, dt: torch.dtype):
        m = copy.deepcopy(model).to(device=device, dtype=dt).set_backend(backend).train()
        logits = m(images.to(device=device, dtype=dt))
        weight = torch.randn(logits.shape, generator=torch.Generator().manual_seed(weight_seed), dtype=torch.float64)
        (logits.double() * weight.to(device)).sum().backward()
        return logits.detach(), {k: p.grad for k, p in m.named_parameters() if p.requires_grad}

    fused, fused_grads = run("triton", dtype)
    ref, ref_grads = run("torch", torch.float64)
    eager, eager_grads = run("torch", dtype) if dtype != torch.float32 else (None, {k: None for k in ref_grads})
    rows = [measure("model logits", fused, ref, eager, "dot", model_rule=True)]
    groups: dict[str, Row] = {}
    for name, grad in fused_grads.items():
        if grad is None:
            grad = torch.full_like(ref_grads[name], float("nan"))  # a parameter the fused path never used
        row = measure("", grad, ref_grads[name], eager_grads[name], "dot", model_rule=True)
        key = "model d" + re.sub(r"^blocks\.\d+\.", "blocks.*.", name)
        worst = groups.get(key)
        if worst is None or not row.rel / row.bound <= worst.rel / worst.bound:
            row.op = key
            groups[key] = row
    return rows + list(groups.values())


def print_table(rows: list[Row], out=None) -> None:
    out = out or sys.stdout
    names = {torch.float32: "fp32", torch.float16: "fp16", torch.bfloat16: "bf16"}
    width = max(len(r.op) for r in rows) + 2
    print(f"{'op':<{width}}{'shape':<20}{'dtype':<7}{'max abs err':>12}{'rel err':>11}{'rel. bound':>12}  result",
          file=out)
    for r in rows:
        shape = "x".join(map(str, r.shape)) or "scalar"
        print(f"{r.op:<{width}}{shape:<20}{names[r.dtype]:<7}{r.max_abs:>12.2e}{r.rel:>11.2e}{r.bound:>12.1e}  "
              f"{'PASS' if r.ok else 'FAIL'}", file=out)


def _ensure_interpreter(argv: Sequence[str]) -> None:
    """Without CUDA the kernels need TRITON_INTERPRET=1 before triton is imported: set it, or, when
    triton is already loaded (importing vit_fast loads it), re-run this command with it set."""
    from vit_fast.kernels._utils import interpreter_active

    if torch.cuda.is_available() or interpreter_active():
        return
    os.environ["TRITON_INTERPRET"] = "1"
    if "triton" in sys.modules:
        sys.stdout.flush()
        os.execv(sys.executable, [sys.executable, "-m", "vit_fast.tools.cli", "check", *argv])


def main(argv: Sequence[str]) -> int:
    """Compare every fused kernel and the fused model with float64 PyTorch on random inputs."""
    parser = argparse.ArgumentParser(prog="vit-fast check", description=main.__doc__)
    parser.add_argument("--model", default="vit_base_patch16_224", help="preset name (default vit_base_patch16_224)")
    parser.add_argument("--batch", type=int, default=None, help="batch size (default 8 on CUDA, 2 without)")
    parser.add_argument("--dtype", choices=sorted(DTYPES), default=None,
                        help="kernel and model dtype (default bf16 on CUDA, fp32 without)")
    parser.add_argument("--img-size", type=int, default=None,
                        help="square image size (default: the preset's on CUDA, a 2x2 patch grid without)")
    parser.add_argument("--depth", type=int, default=None, help=f"blocks (default: the preset's on CUDA, "
                                                                 f"{CPU_DEPTH} without)")
    parser.add_argument("--ops", default=",".join(OPS), help=f"comma-separated subset of {','.join(OPS)}")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(list(argv))
    ops = [op.strip() for op in args.ops.split(",") if op.strip()]
    if unknown := sorted(set(ops) - set(OPS)):
        parser.error(f"unknown ops {unknown}; choose from {', '.join(OPS)}")
    if args.batch is not None and args.batch < 1:
        parser.error("--batch must be >= 1")
    _ensure_interpreter(argv)

    cuda = torch.cuda.is_available()
    device = torch.device("cuda" if cuda else "cpu")
    dtype = DTYPES[args.dtype or ("bf16" if cuda else "fp32")]
    with ieee_fp32_dots():  # fp32 bounds are for IEEE fp32 dots, in eager and kernels
        return _run(args, ops, cuda, device, dtype)


@contextlib.contextmanager
def ieee_fp32_dots():
    """TF32 off for eager and kernels inside, the caller's settings restored after (check.main runs
    in-process from tests and notebooks: a leaked flag would change later kernels' configs)."""
    saved = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
    try:
        yield
    finally:
        torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = saved


def _run(args, ops, cuda: bool, device: torch.device, dtype: torch.dtype) -> int:
    import vit_fast
    from vit_fast.tools.interpreter import install_bf16_shims

    try:
        preset = vit_fast.get_config(args.model)
    except (ValueError, KeyError) as e:
        print(f"vit-fast check: {e}", file=sys.stderr)
        return 2
    overrides = dict(drop_rate=0.0, pos_drop_rate=0.0, proj_drop_rate=0.0, attn_drop_rate=0.0, drop_path_rate=0.0)
    batch = args.batch or (8 if cuda else 2)
    img = args.img_size or (None if cuda else 2 * preset.patch_size[0])
    depth = args.depth if args.depth is not None else (None if cuda else min(preset.depth, CPU_DEPTH))
    overrides.update({k: v for k, v in (("img_size", img), ("depth", depth)) if v is not None})
    try:
        model = vit_fast.create_model(args.model, **overrides)
    except (ValueError, TypeError) as e:
        print(f"vit-fast check: {e}", file=sys.stderr)
        return 2
    cfg = model.config
    if cuda:
        where = f"CUDA ({torch.cuda.get_device_name()}): compiled Triton kernels"
    else:
        shims = install_bf16_shims() and dtype == torch.bfloat16
        where = ("no CUDA: Triton interpreter on CPU, reduced size" + (f" (depth {cfg.depth} of {preset.depth}, "
                 f"img {cfg.img_size[0]} of {preset.img_size[0]})") + (", interpreter bf16 shims on" if shims else ""))
    print(f"vit-fast check: {args.model}, {where}")
    print(f"  batch {batch}, {cfg.num_tokens} tokens, width {cfg.embed_dim}, {cfg.num_heads} heads, "
          f"mlp {cfg.mlp_hidden}, depth {cfg.depth}, dtype {str(dtype).replace('torch.', '')}; "
          f"reference: float64 PyTorch, seed {args.seed}")
    start = time.perf_counter()
    rows = kernel_rows(cfg, batch, dtype, device, ops, args.seed)
    if "model" in ops:
        rows += model_rows(model, batch, dtype, device, args.seed)
    seconds = time.perf_counter() - start
    print()
    print_table(rows)
    failed = [r.op for r in rows if not r.ok]
    print()
    print(f"{len(rows) - len(failed)}/{len(rows)} passed in {seconds:.1f} s" +
          (f"; FAILED: {', '.join(failed)}" if failed else ""))
    return 1 if failed else 0
