"""The route of a model: which implementation runs each of its parts, decided in one place.

A part is one of the four places where vit_fast replaces PyTorch ops; each has its own kernel path and at
least one library path with the same numerics contract (tests/test_route.py compares each with float64):

  patch_embed  fused      the ``patch_embed`` kernel (conv as GEMM + class token + position add)
               eager      cuDNN's convolution, cat, position add (cuDNN may pick a weight-gradient algorithm that is
                          not bitwise repeatable unless torch.use_deterministic_algorithms or cudnn.deterministic
                          is set; the measured table never chose it)
  attention    fused      qkv GEMM (cuBLAS) + vit_fast's flash attention kernels, bias gradient a column sum
               short      the same with the short-sequence kernels (one program per head, S and dP once per tile
                          pair) up to 640 tokens (fp16/bf16, ``kernels.attention.short_supported``), else flash
               sdpa       qkv GEMM + torch's SDPA (cuDNN / flash) on strided views of the packed qkv, the three
                          gradients written into one packed d(qkv) (vit_fast/sdpa.py); not bitwise repeatable
                          on CUDA (the library backward may use atomics)
               eager      qkv GEMM + SDPA as timm writes it (split, permute, SDPA; autograd's copies back); the
                          same SDPA backward, so not bitwise repeatable on CUDA either
  mlp          fused      ``linear_act`` (fc1 as a Triton GEMM with bias + GELU epilogue, fc2 on cuBLAS)
               bias_gelu  fc1 on cuBLAS, then the ``bias_gelu`` kernel, fc2 on cuBLAS
               eager      fc1 on cuBLAS with its bias, torch's GELU, fc2
               (not a candidate: cuBLASLt's GELU epilogue, ``torch._addmm_activation``, tanh on CUDA and erf on
               CPU. It has no autograd formula and returns no pre-activation, so a training step would recompute
               fc1 for GELU's derivative: on the H200, ViT-B/16 b256, 0.449 ms epilogue forward against 0.636 ms
               for cuBLAS fc1 + ``bias_gelu``, but +0.40 ms for the recomputed fc1 GEMM: about 0.2 ms slower
               per block, docs/measured/h200-2026-11-26-probe.md)
  join         fused      ``add_layer_norm`` (bias, LayerScale, dropout, drop-path, residual add, next norm)
               eager      the same as separate torch ops, then F.layer_norm

``Route`` holds one choice per part and where it came from. A model's route is set by ``apply_route``
(which hands each part its implementation) and read back by ``route_of``; ``default_route(device)`` is the
measured table shipped in ``vit_fast/data/measured_routes.json`` for the device's architecture, or the
static route (every part fused) where nothing was measured. ``vit_fast.tuning`` measures on the user's GPU
and applies its winner the same way. The PyTorch backend ignores the route: it is the reference path.
"""
from __future__ import annotations

import dataclasses
import functools
import json
from importlib import resources
from typing import Optional

import torch
import torch.nn as nn

PART_IMPLS: dict[str, tuple[str, ...]] = {  # the first implementation is the static choice
    "patch_embed": ("fused", "eager"),
    "attention": ("fused", "short", "sdpa", "eager"),
    "mlp": ("fused", "bias_gelu", "eager"),
    "join": ("fused", "eager"),
}
# implementations that are not bitwise repeatable on CUDA: never a default, skipped by tuning while
# torch.use_deterministic_algorithms is on. Both attention routes through torch's SDPA: its backward measured not
# bitwise repeatable at 257+ tokens (H200, docs/measured/nvidia-h200-2026-11-27-2156.md)
NONDETERMINISTIC = {("attention", "sdpa"), ("attention", "eager")}


@dataclasses.dataclass(frozen=True)
class Route:
    """One implementation per part (``PART_IMPLS``) and where the choice came from."""

    patch_embed: str = "fused"
    attention: str = "fused"
    mlp: str = "fused"
    join: str = "fused"
    source: str = ""  # empty: named from the choices (the static route, or one set by hand)

    def __post_init__(self):
        for part, impls in PART_IMPLS.items():
            if getattr(self, part) not in impls:
                raise ValueError(f"route: {part} expected one of {list(impls)}, got {getattr(self, part)!r}")
        if not self.source:
            every_part_fused = all(getattr(self, part) == "fused" for part in PART_IMPLS)
            object.__setattr__(self, "source", "static: every part fused" if every_part_fused else "set by hand")

    def choices(self) -> dict[str, str]:
        return {part: getattr(self, part) for part in PART_IMPLS}

    def with_choices(self, choices: dict[str, str], source: str) -> "Route":
        unknown = sorted(set(choices) - set(PART_IMPLS))
        if unknown:
            raise ValueError(f"route: unknown part(s) {unknown}; expected one of {list(PART_IMPLS)}")
        return dataclasses.replace(self, **choices, source=source)


STATIC_ROUTE = Route()


# ------------------------------------------------------------------------------------- measured table
@functools.lru_cache(maxsize=None)
def measured_table() -> dict:
    """The shipped table (vit_fast/data/measured_routes.json): {'tie_fraction', 'archs': {arch: {part:
    {'choice', 'times_ms', 'source'}}}}."""
    text = resources.files("vit_fast").joinpath("data/measured_routes.json").read_text()
    return json.loads(text)


def choice_from_times(part: str, times_ms: dict[str, float], tie_fraction: float) -> str:
    """The measured rule: the fastest measured implementation, unless it beats the static one by less than
    ``tie_fraction`` (one run's noise), and never a non-repeatable one."""
    static = PART_IMPLS[part][0]
    allowed = {impl: t for impl, t in times_ms.items() if (part, impl) not in NONDETERMINISTIC}
    best = min(allowed, key=lambda impl: (allowed[impl], impl != static))
    if static in allowed and allowed[best] >= allowed[static] * (1.0 - tie_fraction):
        return static
    return best


def route_for_arch(arch: Optional[int]) -> Route:
    """The measured route for a compute capability (90, 80, ...), else the static route."""
    table = measured_table()
    entries = table["archs"].get(str(arch)) if arch is not None else None
    if not entries:
        return dataclasses.replace(STATIC_ROUTE, source=f"static: nothing measured on sm_{arch}" if arch else
                                   STATIC_ROUTE.source)
    choices = {part: entries[part]["choice"] if part in entries else PART_IMPLS[part][0] for part in PART_IMPLS}
    return Route(**choices, source=f"measured on sm_{arch} (vit_fast/data/measured_routes.json)")


def default_route(device: torch.device) -> Route:
    """The route a model running on ``device`` takes unless told otherwise."""
    if device.type != "cuda":
        return STATIC_ROUTE
    major, minor = torch.cuda.get_device_capability(device)
    return route_for_arch(10 * major + minor)


# ---------------------------------------------------------------------------------- the model's parts
def _targets(vit: nn.Module) -> dict[str, list[tuple[nn.Module, str]]]:
    """Part -> the (module, attribute) pairs its implementation is handed to (SigLIP's head MLP included)."""
    from .layers import MlpJoin

    head_mlp = getattr(vit.attn_pool, "mlp", None)
    return {"patch_embed": [(vit.patch_embed, "impl")], "attention": [(b.attn, "impl") for b in vit.blocks],
            "mlp": [(b.mlp, "impl") for b in vit.blocks] + ([(head_mlp, "impl")] if isinstance(head_mlp, MlpJoin)
                                                           else []),
            "join": [(b, "join_impl") for b in vit.blocks]}


def apply_route(model: nn.Module, route: Route, explicit: bool = True) -> nn.Module:
    """Hand each part of ``model`` (a vit_fast model, or one ``vit_fast.optimize`` returned) its
    implementation; the model remembers the route (``route_of``). ``explicit``: the model keeps it on every
    device (else it follows ``default_route`` of the device it runs on, as a new model does)."""
    from .interop.optimize import vit_fast_model_of

    vit = vit_fast_model_of(model)
    for part, pairs in _targets(vit).items():
        for module, attr in pairs:
            setattr(module, attr, getattr(route, part))
    vit.route, vit.route_explicit = route, explicit
    return model


def route_of(model: nn.Module) -> Route:
    from .interop.optimize import vit_fast_model_of

    return vit_fast_model_of(model).route
