"""The Vision Transformer (Dosovitskiy et al., 2020) with timm's parameter names and semantics.

    x (B, C, H, W) -> patch_embed -> [cls | reg | patches] + pos_embed -> blocks -> norm
      -> pool (token / avg / ...) -> fc_norm -> head_drop -> head

``VisionTransformer(config)`` or ``VisionTransformer(**config_fields)``; ``create_model(name, **overrides)``
builds a preset. ``model.set_backend('torch' | 'triton' | 'auto')`` switches every module at once.

Fused path (backend resolving to 'triton', see vit_fast/backend.py): one ``patch_embed`` launch builds the
whole token sequence (a dynamic-size pos_embed is resampled first, on the small tensor); the block loop
carries (hidden, residual) pairs so every residual join is fused with the LayerNorm that follows it
(``Block.forward_pair``): norm1 of block 0 is the only stand-alone LayerNorm, the last block's join
computes the final norm (or, with fc_norm / no final norm, is a plain ``bias_dropout_add``).
Under autocast the residual stream keeps the parameter dtype (fp32), as in the reference model (the patch
embedding's GEMM runs in the autocast dtype and its tokens come out in fp32); the kernels see the GEMM outputs
in the autocast dtype, keep statistics in fp32 and return parameter grads in the parameters' dtype. One
visible difference: with a final norm, forward_features returns the autocast dtype (the join kernel writes the
normed output in the branch dtype) where the reference returns fp32; the logits' dtype is the same.
"""
from __future__ import annotations

import functools
import operator
from typing import Iterable, Optional

import torch
import torch.nn as nn
import torch.utils.checkpoint

from .adapters import effective_bias, effective_weight
from .backend import check_backend, check_model_input, resolve_backend
from .kernels._utils import compute_dtype_for
from .kernels.patch_embed import patch_embed as patch_embed_kernel
from .layers import (
    AttentionPoolLatent,
    Block,
    LayerNorm,
    PatchEmbed,
    has_hooks,
    init_weights_vit_timm,
    layer_norm_with_input,
    named_apply,
    reads_norm,
    resample_abs_pos_embed,
    sincos_2d_pos_embed,
    trunc_normal_,
)
from .layers.common import own_hooks, runs_own_forward
from .presets import GLOBAL_POOLS, ViTConfig, get_config, pretrained_cfg
from .route import STATIC_ROUTE, apply_route, default_route


def _refuse_attention_mask(method: str, attn_mask: Optional[torch.Tensor], is_causal: bool) -> None:
    """timm's ViT methods take ``attn_mask`` and ``is_causal`` (timm 1.0.31's do); a ViT encoder attends to every
    token, and the kernels have no mask: None and False are accepted, anything else refused by name."""
    if attn_mask is not None or is_causal:
        raise ValueError(f"{method}: attention masks are not supported (vit_fast's encoders attend to every token); "
                         f"expected attn_mask=None and is_causal=False, got attn_mask "
                         f"{'None' if attn_mask is None else 'of shape ' + str(tuple(attn_mask.shape))} and "
                         f"is_causal={is_causal}")


class VisionTransformer(nn.Module):
    # the route (vit_fast/route.py): until one is set, the measured default of the device it is on
    route, route_explicit, _route_device = STATIC_ROUTE, False, None

    def __init__(self, config: Optional[ViTConfig] = None, **overrides):
        super().__init__()
        # Always a private copy: set_backend / reset_classifier must not change the caller's config.
        cfg = config.replace(**overrides) if config is not None else ViTConfig(**overrides)
        if cfg.weight_init == "skip":  # weights come from elsewhere: the modules' own default init draws
            with torch.random.fork_rng(devices=[]):  # nothing from the global generator (on CPU)
                self._build(cfg)
        else:
            self._build(cfg)
            self.init_weights(needs_reset=False)  # the modules initialised themselves (timm's construction)
        # the route of the device it is built on, as _apply settles it on a move: a model compiled before any eager
        # call keeps the route an eager call would find (no guard failing on the route's attributes later)
        weight = next(self.parameters(), None)
        if weight is not None:
            self._settle_route(weight.device)

    def _build(self, cfg: ViTConfig) -> None:
        self.config = cfg
        self.num_classes = cfg.num_classes
        self.global_pool = cfg.global_pool
        self.num_features = self.head_hidden_size = self.embed_dim = cfg.embed_dim
        self.in_chans = cfg.in_chans
        self.has_class_token = cfg.class_token
        self.pool_include_prefix = False  # timm's option (pool the prefix tokens too) is not implemented
        self.num_prefix_tokens = cfg.num_prefix_tokens
        self.num_reg_tokens = cfg.reg_tokens
        self.no_embed_class = cfg.no_embed_class
        self.dynamic_img_size = cfg.dynamic_img_size
        self.grad_checkpointing = False
        self.backend = cfg.backend
        self.residual_in_fp32 = cfg.residual_in_fp32
        D = cfg.embed_dim

        self.distilled_training = False  # DeiT: both heads' outputs in training when True (set_distilled_training)
        # timm: no patch bias when a pre-norm follows the embedding (CLIP)
        self.patch_embed = PatchEmbed(cfg.img_size, cfg.patch_size, cfg.in_chans, D, bias=not cfg.pre_norm,
                                      strict_img_size=not cfg.dynamic_img_size, backend=cfg.backend)
        self.cls_token = nn.Parameter(torch.zeros(1, 1, D)) if cfg.class_token else None
        self.reg_token = nn.Parameter(torch.zeros(1, cfg.reg_tokens, D)) if cfg.reg_tokens else None
        embed_len = self.patch_embed.num_patches + (0 if cfg.no_embed_class else self.num_prefix_tokens)
        if cfg.pos_embed == "none":
            self.pos_embed = None
        else:
            # A fixed sin-cos embedding is a frozen Parameter (as in MAE) so checkpoints keep the key.
            self.pos_embed = nn.Parameter(torch.zeros(1, embed_len, D), requires_grad=cfg.pos_embed == "learn")
        # after pos_embed, as timm's VisionTransformerDistilled registers it: optimizers keep their state by position
        self.dist_token = nn.Parameter(torch.zeros(1, 1, D)) if cfg.distilled else None
        self.pos_drop = nn.Dropout(cfg.pos_drop_rate)
        self.norm_pre = LayerNorm(D, eps=cfg.norm_eps, backend=cfg.backend) if cfg.pre_norm else nn.Identity()

        # stochastic depth decay rule; on CPU so building under `with torch.device('meta')` works
        dpr = [r.item() for r in torch.linspace(0, cfg.drop_path_rate, cfg.depth, device="cpu")]
        self.blocks = nn.Sequential(*[
            Block(D, cfg.num_heads, cfg.mlp_ratio, qkv_bias=cfg.qkv_bias, qk_norm=cfg.qk_norm,
                  init_values=cfg.init_values, proj_drop=cfg.proj_drop_rate, attn_drop=cfg.attn_drop_rate,
                  drop_path=dpr[i], norm_eps=cfg.norm_eps, act=cfg.act, backend=cfg.backend,
                  mlp_layer=cfg.mlp_layer)
            for i in range(cfg.depth)])
        # timm's feature-extraction description: every block's output, embed_dim channels at 1/patch
        self.feature_info = [dict(module=f"blocks.{i}", num_chs=D, reduction=max(self.patch_embed.patch_size))
                             for i in range(cfg.depth)]
        use_fc_norm = cfg.use_fc_norm
        final_norm = cfg.final_norm and not use_fc_norm
        self.norm = LayerNorm(D, eps=cfg.norm_eps, backend=cfg.backend) if final_norm else nn.Identity()
        self.fc_norm = LayerNorm(D, eps=cfg.norm_eps, backend=cfg.backend) if cfg.final_norm and use_fc_norm \
            else nn.Identity()
        if cfg.global_pool == "map":  # SigLIP: timm's AttentionPoolLatent (vit_fast/layers/attention_pool.py)
            # q and kv biases whatever the blocks', as timm's AttentionPoolLatent is built in its ViT
            self.attn_pool = AttentionPoolLatent(D, cfg.num_heads, cfg.mlp_ratio, qkv_bias=True,
                                                 norm_eps=cfg.norm_eps, act=cfg.act if cfg.mlp_layer == "mlp"
                                                 else "gelu", backend=cfg.backend)
        else:
            self.attn_pool = None
        self.head_drop = nn.Dropout(cfg.drop_rate)
        self.head = nn.Linear(D, cfg.num_classes, bias=cfg.head_bias) if cfg.num_classes > 0 else nn.Identity()
        self.head_dist = self._new_head(cfg.num_classes) if cfg.distilled else None
        # timm's data config (resolve_data_config); create_model / optimize put the preset's or source's
        self.pretrained_cfg = dict(input_size=(cfg.in_chans, *cfg.img_size), fixed_input_size=not cfg.dynamic_img_size,
                                   num_classes=cfg.num_classes, first_conv="patch_embed.proj", classifier="head")

    # ----------------------------------------------------------------------------------------- setup
    def init_weights(self, mode: str = "", needs_reset: bool = True) -> None:
        """timm's default init, in timm's order of draws: dist_token trunc_normal(.02), pos_embed trunc_normal(.02),
        cls/reg tokens normal(1e-6), Linear trunc_normal(.02) with zero bias, LayerScale to init_values, and with
        ``needs_reset`` every other module's ``reset_parameters`` (the patch convolution, the LayerNorms: what an
        ``init_weights()`` after ``to_empty`` needs). ``mode``: only timm's default ''."""
        if mode != "":
            raise NotImplementedError(f"init_weights: only timm's default mode '' is implemented, got {mode!r}; "
                                      f"initialise the timm model with that mode, then vit_fast.optimize it")
        if self.dist_token is not None:
            trunc_normal_(self.dist_token, std=0.02)
        if self.pos_embed is not None:
            if self.config.pos_embed == "sincos":
                with torch.no_grad():
                    self.pos_embed.copy_(self._sincos_pos_embed(self.patch_embed.grid_size, self.pos_embed.dtype))
            else:
                trunc_normal_(self.pos_embed, std=0.02)
        if self.cls_token is not None:
            nn.init.normal_(self.cls_token, std=1e-6)
        if self.reg_token is not None:
            nn.init.normal_(self.reg_token, std=1e-6)
        named_apply(functools.partial(init_weights_vit_timm, needs_reset=needs_reset), self)

    def _new_head(self, num_classes: int, device=None, dtype=None) -> nn.Module:
        if num_classes <= 0:
            return nn.Identity()
        return nn.Linear(self.embed_dim, num_classes, bias=self.config.head_bias, device=device, dtype=dtype)

    def set_distilled_training(self, enable: bool = True) -> None:
        """DeiT (timm's VisionTransformerDistilled): in training mode forward returns (head logits,
        head_dist logits) when enabled; otherwise (and always in eval) the average of the two."""
        if self.dist_token is None:
            raise ValueError("set_distilled_training: the model has no distillation token (distilled=False)")
        self.distilled_training = bool(enable)

    def _apply(self, fn, recurse=True):
        # the route of the device the weights move to, decided here and not at the first forward, which may be
        # traced: a model compiled before it ever ran eagerly runs the same route as one that did
        result = super()._apply(fn, recurse)
        weight = next(self.parameters(), None)
        if weight is not None:
            self._settle_route(weight.device)
        return result

    def _settle_route(self, device: torch.device) -> None:
        """Unless a route was set explicitly, the measured default of ``device`` (once per device)."""
        if not self.route_explicit and device != self._route_device:
            apply_route(self, default_route(device), explicit=False)
            self._route_device = device

    def set_backend(self, backend: str) -> "VisionTransformer":
        """Route every module to 'torch' (reference), 'triton' (fused kernels) or 'auto'."""
        check_backend(backend)
        for module in self.modules():
            if hasattr(module, "backend"):
                module.backend = backend
        self.config.backend = backend
        return self

    def __prepare_scriptable__(self):
        raise NotImplementedError("torch.jit.script does not compile vit_fast's models (Triton launches, Python "
                                  "control flow): use torch.jit.trace, torch.export or torch.compile")

    @property
    def default_cfg(self) -> dict:
        """timm's old name of ``pretrained_cfg`` (the same dict)."""
        return self.pretrained_cfg

    @default_cfg.setter
    def default_cfg(self, value: dict) -> None:
        self.pretrained_cfg = value

    def set_grad_checkpointing(self, enable: bool = True) -> None:
        self.grad_checkpointing = enable

    def get_classifier(self):
        """The head; (head, head_dist) for a distilled model, as timm's VisionTransformerDistilled."""
        return (self.head, self.head_dist) if self.head_dist is not None else self.head

    def group_matcher(self, coarse: bool = False) -> dict:
        """Parameter groups for timm's layer-wise lr decay (timm.optim, layer_decay): the embedding stem,
        one group per block, the final norm last; the same regexes as timm's VisionTransformer."""
        stem = (r"^cls_token|pos_embed|patch_embed|dist_token" if self.dist_token is not None  # timm's DeiT
                else r"^cls_token|reg_token|pos_embed|patch_embed|norm_pre")
        return dict(stem=stem,
                    blocks=[(r"^blocks\.(\d+)", None), (r"^norm", (99999,))])

    def reset_classifier(self, num_classes: int, global_pool: Optional[str] = None) -> None:
        if global_pool is not None:
            if global_pool not in GLOBAL_POOLS:
                raise ValueError(f"global_pool must be one of {GLOBAL_POOLS}, got {global_pool!r}")
            if global_pool == "token" and self.cls_token is None:
                raise ValueError("global_pool='token' needs a class token")
            if self.dist_token is not None and global_pool not in ("", "token"):
                raise ValueError("a distilled model's heads read the class and distillation tokens: global_pool "
                                 f"must stay 'token', got {global_pool!r}")
            if global_pool == "map" and self.attn_pool is None:
                raise ValueError("reset_classifier cannot add attention pooling ('map'); build the model with it")
            if global_pool != "map":
                self.attn_pool = None
            if self.dist_token is None:  # timm's DeiT accepts '' and keeps 'token': its heads read both tokens
                self.global_pool = global_pool
        self.num_classes = num_classes
        device, dtype = self.embed_params_device(), self.patch_embed.projection_weight.dtype
        # PyTorch's Linear init, as timm's reset_classifier: the same seed gives timm's new head
        self.head = self._new_head(num_classes, device, dtype)
        self.head.train(self.training)
        if self.head_dist is not None:
            self.head_dist = self._new_head(num_classes, device, dtype)
            self.head_dist.train(self.training)
        self.config = self.config.replace(num_classes=num_classes, global_pool=self.global_pool)

    def embed_params_device(self) -> torch.device:
        return self.patch_embed.projection_weight.device

    def no_weight_decay(self) -> set[str]:
        """Parameter names that should not get weight decay (besides the 1-D ones), as timm."""
        return {name for name in ("pos_embed", "cls_token", "dist_token", "reg_token")
                if getattr(self, name) is not None}

    def flops_per_image(self, img_size=None) -> int:
        return forward_flops(self.config, img_size)

    # --------------------------------------------------------------------------------------- forward
    def _sincos_pos_embed(self, grid: tuple[int, int], dtype: torch.dtype) -> torch.Tensor:
        pe = sincos_2d_pos_embed(grid, self.embed_dim).to(dtype)[None]
        if not self.no_embed_class and self.num_prefix_tokens:  # prefix tokens get a zero position
            pe = torch.cat([pe.new_zeros(1, self.num_prefix_tokens, self.embed_dim), pe], dim=1)
        return pe

    def _resized_pos_embed(self, grid: tuple[int, int]) -> Optional[torch.Tensor]:
        """The position embedding for a patch grid (resampled only with dynamic_img_size)."""
        pos_embed = self.pos_embed
        if pos_embed is not None and tuple(grid) != self.patch_embed.grid_size:  # only with dynamic_img_size
            if self.config.pos_embed == "sincos":
                pe = self._sincos_pos_embed(grid, pos_embed.dtype).to(pos_embed.device)
                pos_embed = torch.cat([pos_embed[:, :pos_embed.shape[1] - self.patch_embed.num_patches],
                                       pe[:, pe.shape[1] - grid[0] * grid[1]:]], dim=1)
            else:
                pos_embed = resample_abs_pos_embed(
                    pos_embed, new_size=grid, old_size=self.patch_embed.grid_size,
                    num_prefix_tokens=0 if self.no_embed_class else self.num_prefix_tokens)
        return pos_embed

    def _check_pos_embed(self, pos_embed: torch.Tensor, grid: tuple[int, int]) -> None:
        tokens = grid[0] * grid[1] + (0 if self.no_embed_class else self.num_prefix_tokens)
        if self.pos_embed is None or pos_embed.shape != (1, tokens, self.embed_dim):
            raise ValueError(f"pos_embed: expected shape {(1, tokens, self.embed_dim)} for a {grid[0]}x{grid[1]} patch "
                             f"grid{' (the model has no position embedding)' if self.pos_embed is None else ''}, "
                             f"got {tuple(pos_embed.shape)}")

    def _pos_embed(self, x: torch.Tensor, grid: tuple[int, int],
                   pos_embed: Optional[torch.Tensor] = None) -> torch.Tensor:
        B = x.shape[0]
        prefix = [t.expand(B, -1, -1) for t in (self.cls_token, self.dist_token, self.reg_token) if t is not None]
        pos_embed = self._resized_pos_embed(grid) if pos_embed is None else pos_embed
        if pos_embed is None:
            x = torch.cat(prefix + [x], dim=1)
        elif self.no_embed_class:  # position embedding covers the patches only: add, then concat
            x = torch.cat(prefix + [x + pos_embed], dim=1)
        else:  # original ViT: concat, then add
            x = torch.cat(prefix + [x], dim=1) + pos_embed
        return self.pos_drop(x)

    def embed(self, x: torch.Tensor, pos_embed: Optional[torch.Tensor] = None) -> torch.Tensor:
        """Images -> token sequence entering the first block (B, prefix + h*w, D). ``pos_embed``: a
        position embedding the caller made for this input's grid (transformers' interpolate_pos_encoding),
        in place of the model's; any image size divisible by the patch is then accepted."""
        grid = self.patch_embed.check_input(x, any_size=pos_embed is not None)
        # decided once per device, in eager code (a compiled region keeps the route it finds: reading the
        # measured table is file I/O that dynamo does not trace); moving the model settles it before that
        if not torch.compiler.is_compiling():
            self._settle_route(x.device)
        if pos_embed is not None:
            self._check_pos_embed(pos_embed, grid)
        residual_dtype = self._autocast_residual_dtype(x)
        # the kernel adds the position embedding to the projection's output: a patch norm (put in by hand) between
        # them runs the modules
        if (not runs_own_forward(self.patch_embed, PatchEmbed) or not self.patch_embed.fused(x)
                or has_hooks(self.patch_embed) or not isinstance(self.patch_embed.norm, nn.Identity)):
            tokens = self._pos_embed(self.patch_embed(x, any_size=pos_embed is not None), grid, pos_embed)
            tokens = self.norm_pre(tokens)
            return tokens if residual_dtype is None else tokens.to(residual_dtype)
        pos_embed = self._resized_pos_embed(grid) if pos_embed is None else pos_embed
        covers_prefix = not self.no_embed_class
        if pos_embed is None:  # pos_embed='none': the kernel adds zeros
            tokens = grid[0] * grid[1] + (self.num_prefix_tokens if covers_prefix else 0)
            pos_embed = x.new_zeros((1, tokens, self.embed_dim), dtype=self.patch_embed.projection_weight.dtype)
        # The GEMM in the autocast dtype, as timm's convolution; the tokens in the residual stream's dtype (fp32
        # under AMP: timm's pos_embed add promotes the convolution's output) or, with residual_in_fp32=False, in
        # the autocast dtype. The distillation token follows the class token, as a register token would (config:
        # no both).
        proj = self.patch_embed.proj
        tokens = patch_embed_kernel(x, effective_weight(proj), effective_bias(proj), pos_embed, self.cls_token,
                                    self.reg_token if self.dist_token is None else self.dist_token, covers_prefix,
                                    tokens_dtype=residual_dtype or torch.promote_types(compute_dtype_for(x),
                                                                                       pos_embed.dtype))
        # pre_norm (CLIP): the layer_norm kernel on the stream, before block 0's norm1 (a second launch)
        return self.norm_pre(self.pos_drop(tokens))

    def _autocast_residual_dtype(self, x: torch.Tensor) -> Optional[torch.dtype]:
        """The autocast dtype when the residual stream should be kept in it (residual_in_fp32=False under
        autocast), else None: the stream then has timm's dtype (fp32 under autocast)."""
        if self.residual_in_fp32 or not torch.is_autocast_enabled(x.device.type):
            return None
        return torch.get_autocast_dtype(x.device.type)

    def forward_features(self, x: torch.Tensor, attn_mask: Optional[torch.Tensor] = None, is_causal: bool = False, *,
                         pos_embed: Optional[torch.Tensor] = None) -> torch.Tensor:
        """timm's signature (an attention mask is refused, ``_refuse_attention_mask``); ``pos_embed``: position
        embeddings to add instead of the model's (the transformers paths' interpolated ones)."""
        check_model_input(x, self.patch_embed.projection_weight, self.patch_embed.in_chans)  # an fx Proxy first
        _refuse_attention_mask("forward_features", attn_mask, is_causal)
        return self._forward_blocks(self.embed(x, pos_embed))

    def _fuses_across_blocks(self, x: torch.Tensor) -> bool:
        """Whether the blocks run as one fused chain (``_forward_blocks``). The chain calls
        ``Block.forward_pair`` directly, so with hooks anywhere in the blocks (forward or backward) they
        run one by one through ``__call__`` instead: FSDP2's fully_shard gathers parameters in its
        pre-forward hooks, and a user's feature hook expects to fire. So does any block that is not vit_fast's
        (timm's Block put in by hand, nn.Identity, a wrapper such as torch's checkpoint_wrapper, whose forward
        is the point of it)."""
        return (len(self.blocks) > 0 and resolve_backend(self.backend, x) == "triton"
                and not has_hooks(self.blocks) and all(runs_own_forward(blk, Block) and blk.reads_parts()
                                                       for blk in self.blocks))

    def _prunes_to_class_token(self, x: torch.Tensor, chained: bool) -> bool:
        """Whether forward() may run the last block on token 0 alone (class-token pooling reads nothing
        else). Same logits and gradients as the full path, also with drop-path and attention dropout,
        unless the last block draws per-token masks after attention (proj / MLP dropout in training): a
        pruned block would draw different ones. A subclass that overrides forward_features keeps its own."""
        return (self.global_pool == "token" and chained
                and type(self).forward_features is VisionTransformer.forward_features
                and not self.blocks[-1].draws_row_dropout_masks() and not has_hooks(self.norm))

    def _forward_blocks(self, x: torch.Tensor, last_keep_rows: Optional[int] = None, depth: Optional[int] = None,
                        outputs: Optional[list] = None, chained: Optional[bool] = None,
                        final_norm: bool = True) -> torch.Tensor:
        """The block loop (the only one) and the final norm. Fused chain (``_fuses_across_blocks``): the
        blocks pass (hidden, residual) pairs, every join fused with the next LayerNorm (the last block's
        with the final norm); otherwise each block runs through ``__call__`` (hooks fire) on the stream.
        ``last_keep_rows``: the last block computes only the first tokens' output (``Block.forward_pair``,
        fused chain only). ``depth``: the first blocks only (the final norm follows the last of them);
        ``outputs``: a list that receives every block's output tokens (the residual stream after it);
        ``final_norm=False``: the last block's stream without the final norm (nothing computed that is not used,
        so the norm's parameters get no gradient, also under torch.compile, which would give them zeros).
        With grad checkpointing each block is recomputed in the backward: torch.utils.checkpoint restores
        the CPU RNG state first, and the kernels draw their dropout seeds from it (next_seed), so the
        recomputed masks are the same; whether a block runs as one Function is decided before its checkpoint and
        held for the recomputation (it saves what its forward saved)."""
        chained = self._fuses_across_blocks(x) if chained is None else chained  # decided by forward() once
        if (not chained and depth is None and outputs is None and not self.grad_checkpointing
                and own_hooks(self.blocks)):  # a hook on the container fires as on timm, which calls it
            residual = self.blocks(x)
            return self.norm(residual) if final_norm else residual
        blocks = list(self.blocks)[:depth]
        normed = final_norm
        # the last join computes the final norm in its kernel only where calling the norm would do no more
        final_norm = (self.norm if normed and chained and reads_norm(self.norm) and not has_hooks(self.norm)
                      else None)
        hidden, residual = layer_norm_with_input(blocks[0].norm1, x) if chained else (None, x)
        for i, blk in enumerate(blocks):
            last = i + 1 == len(blocks)
            if chained:
                step = functools.partial(blk.forward_pair, next_norm=final_norm if last else blocks[i + 1].norm1,
                                         keep_rows=last_keep_rows if last else None)
            else:
                step = functools.partial(_module_step, blk)
            if self.grad_checkpointing and torch.is_grad_enabled():
                if chained:  # the block's path decided once: its recomputation in the backward takes the same
                    step = functools.partial(step, one_function=blk.runs_as_one_function(
                        hidden, residual, step.keywords["next_norm"], step.keywords["keep_rows"]))
                hidden, residual = torch.utils.checkpoint.checkpoint(step, hidden, residual, use_reentrant=False)
            else:
                hidden, residual = step(hidden, residual)
            if outputs is not None:
                outputs.append(residual)
        if not normed:
            return residual
        return hidden if final_norm is not None else self.norm(residual)

    def forward_intermediates(self, x: torch.Tensor, indices: int | list[int] | None = None,
                              return_prefix_tokens: bool = False, norm: bool = False, stop_early: bool = False,
                              output_fmt: str = "NCHW", intermediates_only: bool = False, output_dict: bool = False,
                              attn_mask: Optional[torch.Tensor] = None, is_causal: bool = False):
        """timm's feature-extraction API, same arguments and returns: the outputs of the chosen blocks
        (``indices``: the last n for an int, all for None, negative from the end) as NCHW maps or NLC
        tokens, with ``norm`` the final norm applied to each, with ``return_prefix_tokens`` paired with
        their class/register tokens; and the final normed tokens unless ``intermediates_only``. On the
        Triton path the fused block chain runs unchanged and hands over each block's residual stream; under
        autocast its final tokens come in the autocast dtype, as forward_features' (module docstring)."""
        if output_fmt not in ("NCHW", "NLC"):
            raise ValueError(f"output_fmt must be 'NCHW' or 'NLC', got {output_fmt!r}")
        _refuse_attention_mask("forward_intermediates", attn_mask, is_causal)
        take = block_indices(len(self.blocks), indices)
        depth = max(take) + 1 if stop_early else len(self.blocks)
        check_model_input(x, self.patch_embed.projection_weight, self.patch_embed.in_chans)
        B = x.shape[0]
        grid = self.patch_embed.check_input(x)
        outputs: list[torch.Tensor] = []
        final = self._forward_blocks(self.embed(x), depth=depth, outputs=outputs, final_norm=not intermediates_only)
        intermediates = [self.norm(y) if norm else y for i, y in enumerate(outputs) if i in take]
        prefix = [y[:, :self.num_prefix_tokens] for y in intermediates] if self.num_prefix_tokens else None
        intermediates = [y[:, self.num_prefix_tokens:] for y in intermediates]
        if output_fmt == "NCHW":
            intermediates = [y.reshape(B, *grid, y.shape[-1]).permute(0, 3, 1, 2).contiguous() for y in intermediates]
        if output_dict:
            result = {"image_intermediates": intermediates}
            if prefix is not None and return_prefix_tokens:
                result["image_intermediates_prefix"] = prefix
            if not intermediates_only:
                result["image_features"] = final
            return result
        if return_prefix_tokens and prefix is not None:
            intermediates = list(zip(intermediates, prefix))
        return intermediates if intermediates_only else (final, intermediates)

    def prune_intermediate_layers(self, indices: int | list[int] = 1, prune_norm: bool = False,
                                  prune_head: bool = True) -> list[int]:
        """timm's companion of forward_intermediates: drop the blocks after the last wanted one (and
        optionally the final norm and the head). Returns the absolute indices kept."""
        take = block_indices(len(self.blocks), indices)
        self.blocks = self.blocks[:max(take) + 1]
        if prune_norm:
            self.norm = nn.Identity()
        if prune_head:
            self.fc_norm = nn.Identity()
            self.reset_classifier(0, "")
        return take

    def pool(self, x: torch.Tensor, pool_type: Optional[str] = None) -> torch.Tensor:
        if self.attn_pool is not None:  # whatever pool_type asks, as timm's pool: the patch tokens
            return self.attn_pool(x[:, self.num_prefix_tokens:])
        pool_type = self.global_pool if pool_type is None else pool_type
        if pool_type == "map":
            raise ValueError("pool_type='map' needs the attention-pool head (global_pool='map' at build time)")
        if pool_type == "token":
            return x[:, 0]
        if not pool_type:
            return x
        x = x[:, self.num_prefix_tokens:]
        if pool_type == "avg":
            return x.mean(dim=1)
        if pool_type == "max":
            return x.amax(dim=1)
        if pool_type == "avgmax":
            return 0.5 * (x.amax(dim=1) + x.mean(dim=1))
        raise ValueError(f"pool: expected pool_type in {list(GLOBAL_POOLS)} or None, got {pool_type!r}")

    def forward_head(self, x: torch.Tensor, pre_logits: bool = False):
        if self.dist_token is not None:  # timm's VisionTransformerDistilled
            x, x_dist = self.head_drop(x[:, 0]), self.head_drop(x[:, 1])
            if pre_logits:
                return self.in_layer_norm_dtype((x + x_dist) / 2)
            x, x_dist = self.head(x), self.head_dist(x_dist)
            if self.distilled_training and self.training:
                return x, x_dist
            return (x + x_dist) / 2
        x = self.head_drop(self.fc_norm(self.pool(x)))
        if pre_logits or isinstance(self.head, nn.Identity):  # features returned: in timm's dtype
            return x if self.global_pool == "map" else self.in_layer_norm_dtype(x)
        return self.head(x)

    def in_layer_norm_dtype(self, x: torch.Tensor) -> torch.Tensor:
        """Tokens or features of the final norm in the dtype a torch LayerNorm gives them (timm's, transformers'):
        fp32 under autocast (autocast runs layer_norm in fp32), where the fused final join wrote the autocast dtype.
        For what a model returns; its own head reads them as they are."""
        normed = not (isinstance(self.norm, nn.Identity) and isinstance(self.fc_norm, nn.Identity))
        if normed and x.dtype in (torch.bfloat16, torch.float16) and torch.is_autocast_enabled(x.device.type):
            return x.float()
        return x

    def forward(self, x: torch.Tensor, attn_mask: Optional[torch.Tensor] = None, is_causal: bool = False
                ) -> torch.Tensor:
        """timm's signature; an attention mask is refused (``_refuse_attention_mask``)."""
        check_model_input(x, self.patch_embed.projection_weight, self.patch_embed.in_chans)  # an fx Proxy first
        _refuse_attention_mask("forward", attn_mask, is_causal)
        chained = self._fuses_across_blocks(x)
        if self._prunes_to_class_token(x, chained):
            # the last block skips the other tokens' proj, MLP and joins; forward_features still
            # returns every token
            keep = 1 if self.dist_token is None else 2  # the heads read the class (and distillation) token
            return self.forward_head(self._forward_blocks(self.embed(x), last_keep_rows=keep, chained=True))
        return self.forward_head(self.forward_features(x))

    # timm methods the README lists as not implemented: each says what to use instead
    def load_pretrained(self, checkpoint_path: str, prefix: str = "") -> None:
        raise NotImplementedError("load_pretrained (timm's .npz big_vision loader) is not implemented: load the .npz "
                                  "into the timm model, then vit_fast.optimize it")

    def set_input_size(self, img_size=None, patch_size=None) -> None:
        raise NotImplementedError("set_input_size is not implemented: create the model with dynamic_img_size=True or "
                                  "rebuild it with img_size=... (vit_fast.resample_abs_pos_embed resamples pos_embed)")

    def get_intermediate_layers(self, *args, **kwargs):
        raise NotImplementedError("get_intermediate_layers is not implemented: "
                                  "forward_intermediates(x, indices, intermediates_only=True) returns the same blocks")

    @torch.no_grad()
    def get_attention_maps(self, x: torch.Tensor, layers: Iterable[int] | None = None) -> dict[int, torch.Tensor]:
        """Softmax attention probabilities {layer: (B, heads, N, N)} of the chosen blocks (default: last one).

        Negative indices count from the end. Computed on the reference path without dropout; rows sum to 1
        over keys, token 0 is the class token when the model has one.
        """
        depth = len(self.blocks)
        if layers is not None and not isinstance(layers, Iterable):
            raise ValueError(f"get_attention_maps: expected layers as an iterable of block indices (e.g. [-1]) or "
                             f"None, got {layers!r}")
        chosen = [-1] if layers is None else list(layers)
        for n, i in enumerate(chosen):
            try:
                if isinstance(i, bool):
                    raise TypeError
                chosen[n] = i = operator.index(i)
            except TypeError:
                raise ValueError(f"get_attention_maps: expected integer block indices, got {i!r}") from None
            if not -depth <= i < depth:
                raise ValueError(f"layer index {i} out of range for a model with {depth} blocks")
        wanted = {i % depth for i in chosen}
        if not wanted:
            return {}
        maps: dict[int, torch.Tensor] = {}
        x = self.embed(x)
        for i, blk in enumerate(self.blocks):
            if i in wanted:
                maps[i] = blk.attn.attention_probs(blk.norm1(x))
            if i >= max(wanted):
                break
            x = blk(x)
        return {i % depth: maps[i % depth] for i in chosen}


def _module_step(block: nn.Module, hidden: None, residual: torch.Tensor) -> tuple[None, torch.Tensor]:
    """One block through ``__call__`` in the pair loop's shape (no fused hidden half)."""
    return None, block(residual)


def block_indices(depth: int, indices: int | Iterable[int] | None) -> list[int]:
    """timm's feature_take_indices: None -> every block, n -> the last n, a list -> those (negative
    counts from the end). Bad indices raise ValueError naming the valid range."""
    if indices is None:
        indices = depth
    if isinstance(indices, int):
        if not 0 < indices <= depth:
            raise ValueError(f"indices: last-n must be in 1..{depth} for a model with {depth} blocks, got {indices}")
        return list(range(depth - indices, depth))
    take = [depth + i if i < 0 else i for i in indices]
    bad = [i for i, t in zip(indices, take) if not 0 <= t < depth]
    if bad or not take:
        raise ValueError(f"indices: expected block indices in [-{depth}, {depth}), got {list(indices)}")
    return take


def forward_flops(config: ViTConfig, img_size=None) -> int:
    """Analytic forward FLOPs per image (2 per multiply-add) of the matrix products: patch-embed GEMM,
    per block qkv, q@k^T, attn@v, proj, fc1, fc2, then the head. Norms, softmax, GELU and adds are
    left out (under 1%). ViT-B/16 at 224: 35.1 GFLOP."""
    cfg = config if img_size is None else config.replace(img_size=img_size)
    D, N, F = cfg.embed_dim, cfg.num_tokens, cfg.mlp_hidden
    patches = cfg.grid_size[0] * cfg.grid_size[1]
    patch_k = cfg.in_chans * cfg.patch_size[0] * cfg.patch_size[1]
    # a SwiGLU MLP's fc1 is F wide (gate + value) and its fc2 reads F/2
    mlp = 2 * N * D * F * (2 if cfg.mlp_layer == "mlp" else 1.5)
    per_block = 2 * N * D * 3 * D + 2 * 2 * N * N * D + 2 * N * D * D + int(mlp)
    heads = 2 if cfg.distilled else 1
    # attention pool ('map'): q, kv over N tokens, one query's attention, proj, MLP on one token
    pool = 2 * D * D + 2 * N * D * 2 * D + 2 * 2 * N * D + 2 * D * D + 2 * 2 * D * F if cfg.global_pool == "map" else 0
    return 2 * patches * patch_k * D + cfg.depth * per_block + pool + heads * 2 * D * cfg.num_classes


def create_model(name: str, **overrides) -> VisionTransformer:
    """Build a preset (see list_models()) with any ViTConfig field overridden, e.g.
    create_model('vit_base_patch16_224', num_classes=10, drop_path_rate=0.1, backend='auto')."""
    if overrides.pop("pretrained", False):
        raise ValueError("pretrained weights are not downloaded by vit_fast; build the model, then "
                         "load_checkpoint(model, path) or convert with from_timm / from_hf / from_torchvision")
    model = VisionTransformer(get_config(name, **overrides))
    model.pretrained_cfg = pretrained_cfg(name)
    return model


def count_params(model: nn.Module, trainable_only: bool = False) -> int:
    return sum(p.numel() for p in model.parameters() if p.requires_grad or not trainable_only)
