"""Triton kernels of vit_fast, installed as ``vit_fast.kernels`` (never import this folder as ``kernels``).

One module per op family, each laid out in the same sections (jit kernels, configs, validation and
launchers (custom ops), autograd, functional, reference, ahead-of-time specs; CONTRIBUTING.md):
``layer_norm``, ``bias_gelu``, ``linear_act`` (its persistent TMA kernels in ``linear_act_tma``), ``swiglu``,
``attention`` (a package split by pass), ``patch_embed``. What they share lives in files named for what it holds,
and no op imports another op's private names:

  _utils.py  interpreter detection (the one TRITON_INTERPRET parser), input checks, device policy,
             dropout seeds and the Philox keep-mask, arch lookup, how many programs fill a GPU
  _math.py   constants (log2 e, ln 2, GELU's), the GELU value/derivative jit math and linear_act's activations
  _gemm.py   the GEMM tile config (GemmTile) and the grouped tile order of the Triton GEMMs
  _rows.py   (M, N) row views, row-input checks, the fixed-order partial-sum reduction
  _join.py   the residual-join jit math (bias, dropout, LayerScale, drop-path) and its validation
  _aot.py    AotSpec and the signature helpers behind each module's ``aot_specs`` (``vit-fast report``)
  _tuning.py measured configs (candidates timed once per shape, the on-disk cache) and the switches that force one

Importing this package runs nothing on a device and compiles nothing.
"""
