"""vit_fast: a drop-in faster Vision Transformer for GPU training."""

__version__ = "0.1.0"
