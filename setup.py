from setuptools import setup

setup(
    name="vit-fast",
    version="0.1.0",
    description="A drop-in faster Vision Transformer for GPU training: fused Triton kernels for "
    "patch embedding, LayerNorm, attention and bias-GELU.",
    python_requires=">=3.10",
    # kernels/ ships as vit_fast.kernels so it can never clash with the unrelated `kernels` package.
    packages=["vit_fast", "vit_fast.kernels"],
    package_dir={"vit_fast": "vit_fast", "vit_fast.kernels": "kernels"},
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
            "torchvision",
            "safetensors",
            "tqdm",
            "matplotlib",
            "scikit-learn",
        ],
    },
    entry_points={"console_scripts": ["vit-fast = vit_fast.cli:main"]},
)
