"""A whole training step (forward, loss, backward, optimizer step) captured once in a CUDA graph and replayed.

A captured step launches its ~1,000 kernels with one call, so the host work around them (Python, autograd,
custom-op dispatch, Triton argument binding) is paid once at capture instead of every step. Measured on an
NVIDIA H200 (torch 2.11, triton 3.6, 2026-11-26, docs/measured/h200-2026-11-26-probe.md): ViT-S/16 batch 256 bf16
went from 46.5 ms (host-bound) to 28.6 ms per step, 1.58x timm eager; at ViT-B/16 the GPU work dominates and the
graph gains 0.6%.

    step = CudaGraphStep(model, optimizer, loss_fn, example_images, example_targets, amp_dtype=torch.bfloat16)
    for images, targets in loader:
        loss = step(images, targets)   # a device tensor, valid until the next call; .item() when you log

The rules a captured step must follow, checked before capture with a clear error:
  - model, batches and optimizer state on one CUDA device; every batch the shape and dtype of the example
    (a graph replays fixed addresses: the last, smaller batch of an epoch must be dropped or padded);
  - an optimizer whose step is capturable and whose fresh state is all zeros (``ZERO_STATE_OPTIMIZERS``: Adam,
    AdamW, Adamax, RAdam, RMSprop, built with ``capturable=True``; torch's SGD has no capturable step), its
    learning rate a float (fixed in the graph) or a tensor on the model's device (what a schedule fills in place);
  - no host synchronisation inside the step: gradient clipping through ``clip_grad_norm_`` (device-side, no
    ``.item()``) is fine, a GradScaler (fp16) is not supported here (its inf checks sync): use bf16;
  - dropout is graph-safe: the fused kernels read their Philox seed from a tensor drawn on the device inside
    the step (``kernels/_utils.next_seed``), so each replay draws fresh masks, as stochastic depth and torch's
    own dropout do; ``torch.manual_seed`` before construction still reproduces a run.

The warm-up steps (kernel compilation, optimizer state) run on the example batch; the weights, the optimizer state
and the random generators are put back afterwards, so the first call is the first step and the run trains as the
eager loop would, dropout masks included. Replays share the captured tensors: the returned loss, ``outputs`` (the
logits) and every gradient are overwritten by the next call. A learning-rate schedule reaches a captured step only
through a tensor learning rate on the device (``AdamW(params, lr=torch.tensor(lr, device=...), capturable=True)``;
schedulers fill it in place). The graph holds the addresses of the optimizer's tensors: load a checkpoint's
optimizer state before building the step, then ``restore_capturable`` (``load_state_dict`` installs the
checkpoint's groups, its learning rate and capturable flag included); loading it into a captured step's optimizer
afterwards replaces tensors the graph no longer sees.
"""
from __future__ import annotations

from typing import Callable, Optional

import torch
import torch.nn as nn

LossFn = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


# Capturable optimizers whose fresh state is all zeros, which is what the warm-up's state is reset to (NAdam's
# mu_product starts at 1, ASGD's eta and Rprop's step sizes at the learning rate: refused, not silently reset wrong).
ZERO_STATE_OPTIMIZERS = (torch.optim.Adam, torch.optim.AdamW, torch.optim.Adamax, torch.optim.RAdam,
                         torch.optim.RMSprop)


def check_capturable(model: nn.Module, optimizer: torch.optim.Optimizer, *tensors: torch.Tensor) -> torch.device:
    """Raise a ValueError naming what a captured training step needs and did not get; return the device."""
    params = [p for p in model.parameters() if p.requires_grad]
    if not params:
        raise ValueError("CudaGraphStep: the model has no trainable parameters")
    device = params[0].device
    if device.type != "cuda":
        raise ValueError(f"CudaGraphStep: a CUDA graph needs the model on a CUDA device, got {device}")
    for t in tensors:
        if not isinstance(t, torch.Tensor) or t.device != device:
            where = t.device if isinstance(t, torch.Tensor) else type(t).__name__
            raise ValueError(f"CudaGraphStep: expected every batch tensor on {device} (the model's device), "
                             f"got {where}")
    if not isinstance(optimizer, ZERO_STATE_OPTIMIZERS):
        names = ", ".join(cls.__name__ for cls in ZERO_STATE_OPTIMIZERS)
        raise ValueError(f"CudaGraphStep: expected one of {names} (a capturable step whose fresh state is all zeros, "
                         f"which the warm-up's state is reset to), got {type(optimizer).__name__}")
    for group in optimizer.param_groups:
        if group.get("capturable") is not True:
            raise ValueError(f"CudaGraphStep: expected an optimizer built with capturable=True (e.g. "
                             f"torch.optim.AdamW(params, fused=True, capturable=True)), got {type(optimizer).__name__} "
                             f"with capturable={group.get('capturable')}")
        lr = group.get("lr")
        if isinstance(lr, torch.Tensor) and lr.device != device:
            raise ValueError(f"CudaGraphStep: expected the learning rate as a float or a tensor on {device}, got a "
                             f"tensor on {lr.device}: the graph would read it once, at capture, and no schedule "
                             f"would reach the replays (after optimizer.load_state_dict, call restore_capturable)")
    return device


def restore_capturable(optimizer: torch.optim.Optimizer, device: torch.device | str) -> None:
    """After ``optimizer.load_state_dict`` (or torch.distributed.checkpoint's ``set_optimizer_state_dict``), which
    installs the checkpoint's param groups: every group capturable again, its learning rate a tensor on ``device``
    holding the loaded value (a schedule fills it in place; a checkpoint brings a float, or a CPU tensor), and the
    step counters float32 on their parameters' device, as a capturable optimizer keeps them. Call it before
    building the ``CudaGraphStep``."""
    for group in optimizer.param_groups:
        group["capturable"] = True
        group["lr"] = torch.tensor(float(group["lr"]), dtype=torch.float32, device=device)
        for p in group["params"]:
            state = optimizer.state.get(p, {})
            if isinstance(state.get("step"), torch.Tensor):
                state["step"] = state["step"].to(device=p.device, dtype=torch.float32)


class CudaGraphStep:
    """Forward under autocast + ``loss_fn`` + backward + ``optimizer.step()``, captured at construction."""

    def __init__(self, model: nn.Module, optimizer: torch.optim.Optimizer, loss_fn: LossFn,
                 example_inputs: torch.Tensor, example_targets: torch.Tensor,
                 amp_dtype: Optional[torch.dtype] = torch.bfloat16, warmup_steps: int = 3,
                 max_grad_norm: Optional[float] = None):
        if amp_dtype == torch.float16:
            raise ValueError("CudaGraphStep: fp16 needs a GradScaler, whose inf checks synchronise the host; "
                             "use amp_dtype=torch.bfloat16 (or None for fp32)")
        if warmup_steps < 1:
            raise ValueError(f"CudaGraphStep: expected warmup_steps >= 1 (the kernels compile and the optimizer "
                             f"state is created before capture), got {warmup_steps}")
        self.device = check_capturable(model, optimizer, example_inputs, example_targets)
        self.model, self.optimizer, self.loss_fn = model, optimizer, loss_fn
        self.amp_dtype, self.max_grad_norm = amp_dtype, max_grad_norm
        with torch.cuda.device(self.device):  # the model's device, whichever is current
            self._capture(example_inputs, example_targets, warmup_steps)

    def _capture(self, example_inputs: torch.Tensor, example_targets: torch.Tensor, warmup_steps: int) -> None:
        model, optimizer = self.model, self.optimizer
        self.inputs = example_inputs.clone()
        self.targets = example_targets.clone()
        # The warm-up steps update the weights and draw random numbers; put the weights, the optimizer state and
        # the generators back after capture (which runs nothing), so the first replay is the first step and a
        # captured run trains exactly as an eager one, dropout masks included.
        weights = [p.detach().clone() for p in model.parameters()]
        state_before = {id(t): t.detach().clone() for st in optimizer.state.values() for t in st.values()
                        if isinstance(t, torch.Tensor)}
        rng = torch.get_rng_state(), torch.cuda.get_rng_state(self.device)

        side = torch.cuda.Stream(self.device)
        side.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(side):  # warm-up off the default stream, as capture requires
            for _ in range(warmup_steps):
                self.optimizer.zero_grad(set_to_none=True)
                self._step()
        torch.cuda.current_stream(self.device).wait_stream(side)

        self.graph = torch.cuda.CUDAGraph()
        self.optimizer.zero_grad(set_to_none=True)  # gradients are allocated inside the graph's pool
        # the warm-up's freed activations go back to the device: blocks cached now stay out of the graph's pool
        torch.cuda.empty_cache()
        # thread_local: CUDA calls of other threads (a DataLoader's pin-memory thread) do not invalidate the capture
        with torch.cuda.graph(self.graph, capture_error_mode="thread_local"):
            self.loss = self._step()
        torch.set_rng_state(rng[0])
        torch.cuda.set_rng_state(rng[1], self.device)
        with torch.no_grad():
            for p, w in zip(model.parameters(), weights):
                p.copy_(w)
            for st in optimizer.state.values():  # state the warm-up created starts from zero (Adam's initial state)
                for t in st.values():
                    if isinstance(t, torch.Tensor) and id(t) in state_before:
                        t.copy_(state_before[id(t)])
                    elif isinstance(t, torch.Tensor):
                        t.zero_()

    def _step(self) -> torch.Tensor:
        with torch.autocast(self.device.type, dtype=self.amp_dtype or torch.float32,
                            enabled=self.amp_dtype is not None):
            out = self.model(self.inputs)
        self.outputs = out.detach()  # the replayed step's logits (for accuracy), overwritten by the next call
        loss = self.loss_fn(out.float(), self.targets)
        loss.backward()
        if self.max_grad_norm:
            torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.max_grad_norm, foreach=True)
        self.optimizer.step()
        return loss.detach()

    def __call__(self, inputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """Copy the batch into the captured buffers and replay; the loss tensor is overwritten by the next call."""
        for name, new, static in (("inputs", inputs, self.inputs), ("targets", targets, self.targets)):
            if new.shape != static.shape or new.dtype != static.dtype:
                raise ValueError(f"CudaGraphStep: expected {name} of shape {tuple(static.shape)} and dtype "
                                 f"{static.dtype} (the captured batch), got {tuple(new.shape)} {new.dtype}; drop or "
                                 f"pad the last batch (DataLoader(drop_last=True))")
        self.inputs.copy_(inputs, non_blocking=True)
        self.targets.copy_(targets, non_blocking=True)
        with torch.cuda.device(self.device):  # replays on the current stream of the graph's device
            self.graph.replay()
        return self.loss
