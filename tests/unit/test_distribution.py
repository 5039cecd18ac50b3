"""What ``pip install`` puts into site-packages: one import package, ``ft_launch``, built
from the product's source folders (pyproject's ``package-dir``), with a short public
``__all__``; a user's own modules named like our folders change nothing."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tomllib
import zipfile
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
PYPROJECT = tomllib.loads((REPO / "pyproject.toml").read_text())
PACKAGE_DIRS: dict[str, str] = PYPROJECT["tool"]["setuptools"]["package-dir"]
#: the top-level packages ft-launch installed before it had one namespace
OLD_TOP_LEVEL = ("launcher", "ftar", "ckpt", "health", "slurm_plugins", "ftcore")


def run_python(args: list[str], cwd: Path, timeout: float = 120) -> subprocess.CompletedProcess:
    """``python ARGS`` in ``cwd`` as a user would run it: the checkout is not on the path."""
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    return subprocess.run([sys.executable, *args], cwd=cwd, env=env, capture_output=True,
                          text=True, timeout=timeout, check=False)


def installed_path(source: Path) -> str:
    """Where a source file lands in the wheel: its folder's package, as package-dir maps."""
    for package, folder in PACKAGE_DIRS.items():
        if source.is_relative_to(REPO / folder):
            return "/".join([*package.split("."), *source.relative_to(REPO / folder).parts])
    raise AssertionError(f"{source} is in no folder of pyproject's package-dir")


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> zipfile.ZipFile:
    """The project's wheel, built from a copy of what pyproject names (no build files
    land in the checkout) with the setuptools installed here (no index needed)."""
    tree = tmp_path_factory.mktemp("source")
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(REPO / name, tree / name)
    for folder in PACKAGE_DIRS.values():
        shutil.copytree(REPO / folder, tree / folder,
                        ignore=shutil.ignore_patterns("__pycache__"))
    out = tmp_path_factory.mktemp("wheel")
    built = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps",
                            "--no-build-isolation", "--no-index", "-w", str(out), str(tree)],
                           capture_output=True, text=True, timeout=240, check=False)
    assert built.returncode == 0, built.stdout + built.stderr
    (path,) = out.glob("ft_launch-*.whl")
    with zipfile.ZipFile(path) as archive:
        yield archive


@pytest.mark.timeout(300)
def test_the_wheel_holds_one_import_package(wheel):
    names = wheel.namelist()
    tops = {name.split("/")[0] for name in names}
    (info,) = [top for top in tops if top.endswith(".dist-info")]
    assert tops - {info} == {"ft_launch"}
    assert wheel.read(f"{info}/top_level.txt").decode().split() == ["ft_launch"]


@pytest.mark.timeout(300)
def test_the_wheel_holds_every_source_file_under_its_package(wheel):
    """pyproject lists the packages by name: a subpackage left off would be missing."""
    names = set(wheel.namelist())
    sources = [path for folder in PACKAGE_DIRS.values() for path in (REPO / folder).rglob("*.py")
               if "__pycache__" not in path.parts]
    missing = [str(path.relative_to(REPO)) for path in sources if installed_path(path) not in names]
    assert not missing, f"not in the wheel (add its package to pyproject): {missing}"


@pytest.mark.timeout(300)
def test_every_console_script_runs_from_the_one_package(wheel):
    (info,) = {name.split("/")[0] for name in wheel.namelist() if ".dist-info/" in name}
    lines = wheel.read(f"{info}/entry_points.txt").decode().splitlines()
    scripts = dict(map(str.strip, line.split("=", 1)) for line in lines if "=" in line)
    assert sorted(scripts) == ["ft-epilog", "ft-gate", "ft-healthcheck", "ft-launch", "ft-prolog"]
    assert all(target.startswith("ft_launch.") for target in scripts.values()), scripts


@pytest.mark.timeout(120)
def test_the_installed_project_puts_only_ft_launch_on_the_path(tmp_path):
    code = ("import importlib.util; "
            f"print([n for n in {OLD_TOP_LEVEL!r} if importlib.util.find_spec(n)]); "
            "print(importlib.util.find_spec('ft_launch') is not None)")
    done = run_python(["-c", code], tmp_path)
    assert done.returncode == 0, done.stderr
    assert done.stdout.split("\n")[:2] == ["[]", "True"], done.stdout


@pytest.mark.timeout(180)
def test_a_users_modules_named_like_ours_do_not_break_the_imports(tmp_path):
    """A script beside its own ``launcher.py``, ``health/`` and the rest (each one refuses
    to be imported): the training API and every layer still import."""
    for name in OLD_TOP_LEVEL:
        refuse = f"raise SystemExit('the user\\'s {name} was imported')\n"
        if name in ("health", "ckpt"):
            (tmp_path / name).mkdir()
            (tmp_path / name / "__init__.py").write_text(refuse)
        else:
            (tmp_path / f"{name}.py").write_text(refuse)
    (tmp_path / "train.py").write_text(
        "import ft_launch.launcher.cli, ft_launch.health.aggregation, ft_launch.ckpt.rank\n"
        "import ft_launch.ftar, ft_launch.slurm_plugins.gate\n"
        "from ft_launch import FtOptimizer, Manager, ResidentAdamW, StepKind, ft_manager\n"
        "print('imported', ft_manager.__module__)\n")
    done = run_python(["train.py"], tmp_path, timeout=150)
    assert done.returncode == 0, done.stdout + done.stderr
    assert done.stdout.strip() == "imported ft_launch.launcher.worker.torch_api"
    cli = run_python(["-m", "ft_launch.launcher.cli", "--help"], tmp_path)
    assert cli.returncode == 0 and "usage: ft-launch" in cli.stdout, cli.stdout + cli.stderr


@pytest.mark.timeout(120)
def test_the_front_door_loads_its_names_on_first_use(tmp_path):
    """``import ft_launch`` (what the Slurm plugins and the controller import first) loads
    neither torch nor the worker runtime; each public name resolves when used."""
    code = ("import sys, ft_launch\n"
            "print(sorted(m for m in ('torch', 'ft_launch.launcher.worker.torch_api') "
            "if m in sys.modules))\n"
            "print(sorted(ft_launch.__all__) == sorted(ft_launch._PUBLIC))\n"
            "print(all(getattr(ft_launch, name) is not None for name in ft_launch.__all__))\n"
            "print(set(ft_launch.__all__) <= set(dir(ft_launch)))\n"
            "try:\n    ft_launch.launch\nexcept AttributeError as error:\n    print(error)\n")
    done = run_python(["-c", code], tmp_path)
    assert done.returncode == 0, done.stderr
    assert done.stdout.splitlines() == [
        "[]", "True", "True", "True", "module 'ft_launch' has no attribute 'launch'"]

