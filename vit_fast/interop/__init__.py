"""Interop: converters from timm / transformers / torchvision weights, ``optimize`` and the Hugging Face wrapper."""
