"""Packaging: kernels/ ships as vit_fast.kernels in a built wheel, and nothing imports a top-level `kernels`."""
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
    for name in ("setup.py", "README.md", "vit_fast", "kernels"):
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
    assert not [n for n in names if n.startswith("kernels/")]
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
