"""Preset overrides of ViTConfig for the fine-tuning families, with the exact hyper-parameters of the timm
model of the same name (timm 1.0.x; tests/test_families.py compares them on the meta device). Merged into
``presets.PRESETS``. The fields pre_norm, act='quick_gelu', mlp_layer and global_pool='map' are described in
vit_fast/interop/families.py."""
from __future__ import annotations

_B = dict(embed_dim=768, depth=12, num_heads=12)
_L = dict(embed_dim=1024, depth=24, num_heads=16)
_CLIP = dict(pre_norm=True, norm_eps=1e-5)
_SIGLIP = dict(class_token=False, global_pool="map", num_classes=0)
# DINOv2 is trained at 518 px (37x37 patches of 14) and ships without a classifier.
_DINOV2 = dict(patch_size=14, img_size=518, init_values=1e-5, num_classes=0)

FAMILY_PRESETS: dict[str, dict] = {
    # CLIP image towers (timm's defaults: 1000-class head; OpenAI weights use QuickGELU and a 512-d projection)
    "vit_base_patch16_clip_224": dict(**_B, **_CLIP, patch_size=16, img_size=224),
    "vit_large_patch14_clip_224": dict(**_L, **_CLIP, patch_size=14, img_size=224),
    "vit_base_patch16_clip_quickgelu_224": dict(**_B, **_CLIP, patch_size=16, img_size=224, act="quick_gelu",
                                                num_classes=512),
    # SigLIP: no class token, attention-pool ('map') head; So400m: width 1152, 16 heads of 72, MLP 4304
    "vit_base_patch16_siglip_224": dict(**_B, **_SIGLIP, patch_size=16, img_size=224),
    "vit_so400m_patch14_siglip_224": dict(_SIGLIP, embed_dim=1152, depth=27, num_heads=16, mlp_ratio=3.7362,
                                          patch_size=14, img_size=224),
    # DINOv2; giant: SwiGLU MLP (fc1 8192 = gate 4096 + value 4096; timm's mlp_ratio 2.66667 * 2)
    "vit_small_patch14_dinov2": dict(_DINOV2, embed_dim=384, depth=12, num_heads=6),
    "vit_base_patch14_dinov2": dict(**_DINOV2, **_B),
    "vit_large_patch14_dinov2": dict(**_DINOV2, **_L),
    "vit_giant_patch14_dinov2": dict(_DINOV2, embed_dim=1536, depth=40, num_heads=24, mlp_ratio=2.66667 * 2,
                                     mlp_layer="swiglu_packed"),
    # DeiT with a distillation token and head
    "deit_base_distilled_patch16_224": dict(_B, patch_size=16, img_size=224, distilled=True),
}

_OPENAI_CLIP = dict(mean=(0.48145466, 0.4578275, 0.40821073), std=(0.26862954, 0.26130258, 0.27577711))
_HALF = dict(mean=(0.5, 0.5, 0.5), std=(0.5, 0.5, 0.5))
_IMAGENET = dict(mean=(0.485, 0.456, 0.406), std=(0.229, 0.224, 0.225))
# timm's data config of each family preset's default weights (crop and normalisation; tests/test_clients.py)
FAMILY_DATA_CFG: dict[str, dict] = {
    "vit_base_patch16_clip_224": dict(crop_pct=0.95, **_OPENAI_CLIP),
    "vit_large_patch14_clip_224": dict(crop_pct=1.0, **_HALF),
    "vit_base_patch16_clip_quickgelu_224": dict(crop_pct=1.0, **_OPENAI_CLIP),
    "vit_base_patch16_siglip_224": dict(crop_pct=0.9, **_HALF),
    "vit_so400m_patch14_siglip_224": dict(crop_pct=0.9, **_HALF),
    **{name: dict(crop_pct=1.0, **_IMAGENET) for name in FAMILY_PRESETS if name.endswith("dinov2")},
    "deit_base_distilled_patch16_224": dict(crop_pct=0.9, **_IMAGENET),
}
