"""Which implementation a module runs: the fused Triton kernels or the pure-PyTorch reference.

    'torch'   the reference ops (nn.Linear, F.layer_norm, SDPA, ...): runs anywhere, the test oracle.
    'triton'  the fused kernels (vit_fast.kernels); needs CUDA tensors, or CPU tensors with the
              Triton interpreter on (TRITON_INTERPRET=1 set before triton is imported). Anything
              else is a RuntimeError, never a silent fallback to the reference.
    'auto'    'triton' for CUDA tensors (and for CPU tensors under the interpreter, which is how
              the CPU test suite runs the kernels), 'torch' otherwise.

The choice is made per call from the tensor the module receives, so one model follows
``model.to(device)`` without being rebuilt.
"""
from __future__ import annotations

import torch

from vit_fast.kernels._utils import interpreter_active

BACKENDS = ("auto", "triton", "torch")


def check_backend(backend: str) -> str:
    """Validate a backend name (ValueError naming the choices)."""
    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")
    return backend


def kernels_can_run_on(device: torch.device) -> bool:
    return device.type == "cuda" or (device.type == "cpu" and interpreter_active())


def resolve_backend(requested: str, tensor: torch.Tensor) -> str:
    """'triton' or 'torch' for a module asked to run ``requested`` on ``tensor``'s device. Under a torch.func
    transform (vmap, grad, jacrev, ...) 'auto' is the reference: the kernels' autograd Functions have no vmap or
    functorch rules; so it is for float64 tensors, which the kernels do not compute in."""
    check_backend(requested)
    if requested == "torch":
        return "torch"
    if not torch.compiler.is_compiling() and torch._C._functorch.maybe_current_level() is not None:
        if requested == "auto":
            return "torch"
        raise ValueError("backend='triton' under a torch.func transform (vmap, grad, jacrev, ...): the fused "
                         "kernels' autograd Functions have no functorch rules; use backend='auto' (the reference "
                         "PyTorch path under transforms) or 'torch'")
    if tensor.dtype == torch.float64:  # a model.double() (gradcheck, a float64 reference)
        if requested == "auto":
            return "torch"
        raise ValueError("backend='triton': the fused kernels compute in float32, float16 or bfloat16, got float64 "
                         "tensors; use backend='auto' or 'torch' (the reference PyTorch path runs float64)")
    if kernels_can_run_on(tensor.device):
        return "triton"
    if requested == "auto":
        return "torch"
    raise RuntimeError(
        f"backend='triton' needs CUDA tensors (or CPU tensors with TRITON_INTERPRET=1 set before triton "
        f"is imported), got a tensor on {tensor.device}; use backend='auto' or 'torch' to run the reference "
        f"PyTorch path there")


IMAGE_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


def check_image_batch(x, in_chans: int) -> None:
    """A floating-point 4-D tensor (B, C, H, W): the shape checks every image entry point shares."""
    if isinstance(x, torch.fx.Proxy):
        raise NotImplementedError("torch.fx symbolic tracing (timm's create_feature_extractor, get_graph_node_names) "
                                  "does not trace vit_fast's models (their paths depend on the input's shape, "
                                  "device and dtype): use forward_intermediates, timm's FeatureGetterNet / "
                                  "FeatureHookNet, forward hooks, torch.export or torch.compile")
    if not isinstance(x, torch.Tensor):
        raise ValueError(f"expected a torch.Tensor image batch (B, {in_chans}, H, W), got {type(x).__name__}")
    if x.dim() != 4:
        raise ValueError(f"expected a 4-D image batch (B, C, H, W) with C={in_chans}, "
                         f"got a {x.dim()}-D tensor of shape {tuple(x.shape)}")
    if not x.is_floating_point():
        raise ValueError(f"expected a floating-point image batch (float32/float16/bfloat16), got {x.dtype}")


def check_model_input(x, weight: torch.Tensor, in_chans: int) -> None:
    """The one check at a model's entry, before either backend looks at ``x`` (so both raise the same error).

    ``weight``: the patch projection's weight (its dtype and device are the model's). Raises ValueError naming
    what was expected for: a non-tensor, a tensor that is not 4-D or not floating point, a tensor on another
    device type than the model, and -- outside autocast -- a dtype other than the model's (timm does not cast
    either; under autocast any of float32/float16/bfloat16 is accepted, autocast casts it). Batch 0 is valid."""
    check_image_batch(x, in_chans)
    if x.device.type != weight.device.type and weight.device.type != "meta":
        raise ValueError(f"expected the image batch on the model's device ({weight.device}), got a tensor on "
                         f"{x.device}; move one of them with .to()")
    if torch.is_autocast_enabled(x.device.type):
        if x.dtype not in IMAGE_DTYPES:
            raise ValueError(f"expected a float32/float16/bfloat16 image batch under autocast, got {x.dtype}")
    elif x.dtype != weight.dtype:
        raise ValueError(f"expected an image batch of the model's dtype {weight.dtype} (outside autocast nothing "
                         f"is cast), got {x.dtype}; convert it with x.to({weight.dtype}) or run under "
                         f"torch.autocast")
