"""Patch embedding: one strided convolution, or the ``patch_embed`` kernel (conv as a GEMM with bias)."""
from __future__ import annotations

import torch
import torch.nn as nn

from ..adapters import effective_bias, effective_weight, fusable_linear, patchify_problem
from ..backend import check_backend, check_image_batch, resolve_backend
from ..kernels.patch_embed import patch_embed as patch_embed_kernel
from .common import has_hooks, to_2tuple


class PatchEmbed(nn.Module):
    """Image (B, C, H, W) -> patch tokens (B, H/p * W/p, D) with one strided convolution.

    With ``strict_img_size`` the input must be exactly ``img_size``; otherwise any size divisible by the
    patch works (dynamic_img_size). Bad input raises ValueError naming what was expected.
    """

    impl = "fused"  # the route's choice (vit_fast/route.py): 'fused' | 'eager' (the conv path on the GPU too)

    def __init__(self, img_size=224, patch_size=16, in_chans: int = 3, embed_dim: int = 768,
                 bias: bool = True, strict_img_size: bool = True, backend: str = "auto"):
        super().__init__()
        self.img_size = to_2tuple(img_size)
        self.patch_size = to_2tuple(patch_size)
        for s, p in zip(self.img_size, self.patch_size):
            if s % p:
                raise ValueError(f"img_size {self.img_size} must be divisible by patch_size {self.patch_size}")
        self.grid_size = (self.img_size[0] // self.patch_size[0], self.img_size[1] // self.patch_size[1])
        self.num_patches = self.grid_size[0] * self.grid_size[1]
        self.in_chans = in_chans
        self.embed_dim = embed_dim
        self.strict_img_size = strict_img_size
        self.backend = check_backend(backend)
        self.proj = nn.Conv2d(in_chans, embed_dim, kernel_size=self.patch_size, stride=self.patch_size, bias=bias)
        self.norm = nn.Identity()

    def check_input(self, x: torch.Tensor, any_size: bool = False) -> tuple[int, int]:
        """Validate an image batch; returns its patch grid (H/p, W/p). ``any_size``: any size divisible
        by the patch is accepted even with strict_img_size (the caller brings its own position embedding)."""
        check_image_batch(x, self.in_chans)
        B, C, H, W = x.shape
        if C != self.in_chans:
            raise ValueError(f"expected {self.in_chans} input channels (in_chans), got {C} (shape {tuple(x.shape)})")
        ph, pw = self.patch_size
        if H % ph or W % pw:
            raise ValueError(f"expected image height and width divisible by patch size {self.patch_size}, "
                             f"got ({H}, {W})")
        if self.strict_img_size and not any_size and (H, W) != self.img_size:
            raise ValueError(f"expected images of size {self.img_size} (H, W), got ({H}, {W}); "
                             f"create the model with img_size=({H}, {W}) or dynamic_img_size=True")
        return H // ph, W // pw

    @property
    def projection_weight(self) -> torch.Tensor:
        """The projection's weight (a wrapped projection's first parameter): the device and dtype images go to."""
        if fusable_linear(self.proj):
            return self.proj.weight
        return next(self.proj.parameters())

    def fused(self, x: torch.Tensor) -> bool:
        """The ``patch_embed`` kernel runs: Triton backend, and ``proj`` is a convolution it can read
        (vit_fast/adapters.py; square patches) with no hook on it."""
        return (self.impl == "fused" and resolve_backend(self.backend, x) == "triton" and fusable_linear(self.proj)
                and self.patch_size[0] == self.patch_size[1] and patchify_problem(self.proj, self.patch_size) is None
                and not has_hooks(self, inside=True))

    def forward(self, x: torch.Tensor, any_size: bool = False) -> torch.Tensor:
        grid = self.check_input(x, any_size)
        if self.fused(x):
            # Used alone the kernel adds no tokens and a zero position embedding (the model passes its own).
            zero_pos = x.new_zeros((1, grid[0] * grid[1], self.embed_dim), dtype=self.proj.weight.dtype)
            x = patch_embed_kernel(x, effective_weight(self.proj), effective_bias(self.proj), zero_pos)
        else:
            x = self.proj(x).flatten(2).transpose(1, 2)  # (B, D, h, w) -> (B, h*w, D)
        return self.norm(x)
