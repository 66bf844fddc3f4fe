"""Triton kernels of vit_fast, installed as ``vit_fast.kernels`` (never import this folder as ``kernels``).

One module per op family (layer_norm, bias_gelu, attention, patch_embed); ``_utils`` holds the
launcher helpers they share. Importing this package runs nothing on a device and compiles nothing.
"""
