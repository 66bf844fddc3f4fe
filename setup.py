from setuptools import find_packages, setup

setup(
    name="vit-fast",
    version="0.1.0",
    description="A drop-in faster Vision Transformer for GPU training: fused Triton kernels for "
    "patch embedding, LayerNorm, attention and bias-GELU.",
    python_requires=">=3.10",
    # The kernels live in vit_fast/kernels (the top-level kernels/ is a relative symlink to it), so every
    # import resolves by ordinary path lookup inside the checkout it runs from: no package_dir mapping.
    packages=find_packages(include=["vit_fast", "vit_fast.*"]),
    # the measured routes, the measured GPU runs and the stored step counts (vit_fast/route.py, tools/calibration.py)
    package_data={"vit_fast": ["data/*.json", "data/measured/*.json", "data/counts/*.json"]},
    # Tested stacks (README "Supported versions"; .ci/run runs the suite on both): torch 2.14.1 + triton 3.8.0
    # (constraints.txt) and torch 2.11.0 + triton 3.6.0 + torchvision 0.26.0 (.ci/constraints-torch2.11.txt,
    # what the project's GPU machines carry), each with numpy 2.4 and pytest 9.0/9.2. Version differences are
    # bridged in vit_fast/_compat.py and vit_fast/tools/interpreter.py.
    install_requires=[
        "torch>=2.11",
        "triton>=3.6; platform_system == 'Linux'",
        "numpy>=2.3",
    ],
    extras_require={
        "test": [
            "pytest>=9.0",
            "pytest-benchmark",
            "pytest-xdist",
            "setuptools>=70.1",  # tests/test_packaging.py builds the wheel without build isolation (bdist_wheel)
            "ruff",  # .ci/run lints before the tests (pyproject.toml)
            "hypothesis",
            "timm",
            "transformers",
            "accelerate",
            "torchvision>=0.26",
            "open_clip_torch",  # tests/test_families.py: open_clip image towers
            "peft",  # tests/test_adapters.py: LoRA on the fused path
            "ftfy",
            "safetensors",
            "tqdm",
            "matplotlib",
            "scikit-learn",
        ],
    },
    entry_points={"console_scripts": ["vit-fast = vit_fast.tools.cli:main"]},
)
