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
    install_requires=[
        "torch",
        "triton; platform_system == 'Linux'",
        "numpy",
    ],
    extras_require={
        "test": [
            "pytest",
            "pytest-benchmark",
            "pytest-xdist",
            "hypothesis",
            "timm",
            "transformers",
            "accelerate",
            "torchvision",
            "safetensors",
            "tqdm",
            "matplotlib",
            "scikit-learn",
        ],
    },
    entry_points={"console_scripts": ["vit-fast = vit_fast.tools.cli:main"]},
)
