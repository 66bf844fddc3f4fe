"""Packaging: the kernels ship as vit_fast.kernels (top-level kernels/ is a relative symlink to vit_fast/kernels), a
second checkout imports only its own files, nothing imports a top-level `kernels`, and the library needs only torch,
triton and numpy."""
import os
import pathlib
import re
import shutil
import subprocess
import sys
import zipfile

import pytest

REPO = pathlib.Path(__file__).resolve().parents[1]
TOP_LEVEL_KERNELS = re.compile(r"^\s*(import\s+kernels\b|from\s+kernels\b)", re.MULTILINE)


def test_no_module_imports_kernels_as_a_top_level_name():
    offenders = [str(path.relative_to(REPO)) for path in REPO.rglob("*.py")
                 if not any(part.startswith(".") or part in ("build", "tmp") for part in path.relative_to(REPO).parts)
                 and TOP_LEVEL_KERNELS.search(path.read_text(errors="replace"))]
    assert offenders == [], f"use `vit_fast.kernels`, not a top-level `kernels` import, in: {offenders}"
    assert TOP_LEVEL_KERNELS.search("from kernels import attention") and not TOP_LEVEL_KERNELS.search(
        "from vit_fast.kernels import attention")


@pytest.fixture(scope="module")
def wheel(tmp_path_factory):
    """Build the wheel from a copy of the sources: setuptools reuses build/lib in the source tree, which can
    hold files deleted since, and it would leave build/ and *.egg-info behind in the repo."""
    src, out = tmp_path_factory.mktemp("src"), tmp_path_factory.mktemp("wheel")
    skip = shutil.ignore_patterns("__pycache__", "*.pyc", "build", "*.egg-info")
    for name in ("setup.py", "README.md", "vit_fast"):
        if (REPO / name).is_dir():
            shutil.copytree(REPO / name, src / name, ignore=skip)
        elif (REPO / name).exists():
            shutil.copy2(REPO / name, src / name)
    result = subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q", "-w", str(out), str(src)],
        capture_output=True, text=True, timeout=300, cwd=out)
    assert result.returncode == 0, result.stdout + result.stderr
    (path,) = out.glob("vit_fast-*.whl")
    return path


def test_wheel_holds_vit_fast_kernels_and_no_top_level_kernels(wheel):
    names = zipfile.ZipFile(wheel).namelist()
    assert "vit_fast/kernels/_utils.py" in names and "vit_fast/kernels/__init__.py" in names
    assert "vit_fast/model.py" in names
    for sub in ("interop", "tools", "training"):
        assert f"vit_fast/{sub}/__init__.py" in names
    assert not [n for n in names if n.startswith("kernels/")]
    # the data the routes and the calibrated speed model read (vit_fast/route.py, vit_fast/tools/calibration.py)
    assert {"vit_fast/data/measured_routes.json", "vit_fast/data/measured/h200-2026-11-26.json",
            "vit_fast/data/counts/vit_base_patch16_224.json"} <= set(names)
    entry_points = next(n for n in names if n.endswith("entry_points.txt"))
    assert "vit-fast = vit_fast.tools.cli:main" in zipfile.ZipFile(wheel).read(entry_points).decode()


def test_unzipped_wheel_imports_vit_fast_kernels_without_the_repo(wheel, tmp_path):
    site = tmp_path / "site"
    zipfile.ZipFile(wheel).extractall(site)
    code = ("import sys, vit_fast, vit_fast.kernels, vit_fast.kernels._utils as u; "
            f"assert not any(p.rstrip('/') == {str(REPO)!r} for p in sys.path); "
            "assert vit_fast.__file__.startswith(sys.argv[1]), vit_fast.__file__; "
            "assert vit_fast.kernels.__file__.startswith(sys.argv[1]); "
            "print(u.interpreter_active.__module__)")
    env = {"PATH": "/usr/bin:/bin", "PYTHONPATH": str(site), "HOME": str(tmp_path)}
    result = subprocess.run([sys.executable, "-c", code, str(site)], capture_output=True, text=True,
                            timeout=120, cwd=tmp_path, env=env)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "vit_fast.kernels._utils"


def test_top_level_kernels_is_a_relative_symlink_into_the_package():
    link = REPO / "kernels"
    assert link.is_symlink() and not os.path.isabs(os.readlink(link)), "kernels/ must be a relative symlink"
    assert link.resolve() == (REPO / "vit_fast" / "kernels").resolve()
    assert "package_dir=" not in (REPO / "setup.py").read_text()


def test_a_second_checkout_imports_its_own_kernels(tmp_path):
    """Two clones side by side (one of them installed editable): code run from a clone's root imports vit_fast and
    every vit_fast.kernels module from that clone, by ordinary path lookup."""
    clone = tmp_path / "second-clone"
    if (REPO / ".git").exists() and shutil.which("git"):
        subprocess.run(["git", "clone", "-q", str(REPO), str(clone)], check=True, timeout=120)
    else:  # an unpacked source tree: copy it, keeping the symlink as a symlink
        shutil.copytree(REPO, clone, symlinks=True, ignore=shutil.ignore_patterns("__pycache__", "*.egg-info"))
    code = ("import sys, importlib, pkgutil, vit_fast.kernels as k; "
            "mods = [importlib.import_module('vit_fast.kernels.' + m.name) for m in pkgutil.iter_modules(k.__path__)]; "
            "import vit_fast.tools.cli, vit_fast.interop.optimize, vit_fast.training.checkpoint; "
            "mods += [vit_fast.tools.cli, vit_fast.interop.optimize, vit_fast.training.checkpoint]; "
            "print('\\n'.join(m.__file__ for m in mods))")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, cwd=clone)
    assert result.returncode == 0, result.stderr
    files = result.stdout.split()
    assert len(files) >= 8 and any(f.endswith(os.path.join("attention", "__init__.py")) for f in files)
    outside = [f for f in files if not pathlib.Path(f).resolve().is_relative_to(clone.resolve())]
    assert outside == [], f"modules imported from another checkout: {outside}"


OPTIONAL = ("timm", "transformers", "torchvision", "tqdm", "matplotlib", "sklearn", "safetensors", "hypothesis",
            "open_clip", "accelerate", "pytest")


def test_library_floor_needs_only_torch_triton_numpy(tmp_path):
    """import vit_fast and a forward/backward of create_model(...) with the optional dependencies blocked."""
    code = f"""
import sys, importlib.abc
class Block(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name.split('.')[0] in {OPTIONAL!r}:
            raise ModuleNotFoundError(f'blocked optional dependency: {{name}}')
sys.meta_path.insert(0, Block())
import torch, vit_fast
model = vit_fast.create_model('vit_tiny_patch16_224', img_size=32, patch_size=8, depth=2, num_classes=5)
model(torch.randn(2, 3, 32, 32)).sum().backward()
vit_fast.save_checkpoint  # names stay importable (their optional readers load lazily)
loaded = sorted(m for m in sys.modules if m.split('.')[0] in {OPTIONAL!r})
assert not loaded, loaded
print('ok')
"""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=180, cwd=REPO,
                            env=env)
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout.strip().endswith("ok")
