"""The controller, CLI and Slurm plugins must start fast: they never import torch, nor
matplotlib (the optional ``[plot]`` extra, imported only when a figure is drawn)."""

import pkgutil
import subprocess
import sys

import pytest

from ft_launch.launcher import controller

#: every module of the controller, and the rest of the control plane
CONTROLLER = [f"{controller.__name__}.{m.name}" for m in pkgutil.iter_modules(controller.__path__)]
CONTROL_PLANE = [*CONTROLLER, "ft_launch.config", "ft_launch.errors", "ft_launch.events",
                 "ft_launch.slurm.client", "ft_launch.slurm.parse", "ft_launch.launcher.cli",
                 "ft_launch.launcher.heartbeat",
                 "ft_launch.launcher.quorum", "ft_launch.launcher.worker.manager",
                 "ft_launch.launcher.reporting.summary", "ft_launch.launcher.reporting.status",
                 "ft_launch.launcher.reporting.live", "ft_launch.launcher.reporting.timeline",
                 "ft_launch.launcher.reporting.plots"]


@pytest.mark.parametrize("module", CONTROL_PLANE)
def test_module_does_not_import_torch(module):
    code = (f"import sys, {module}; "
            "bad = [m for m in ('torch', 'numpy.testing', 'matplotlib') if m in sys.modules]; "
            "print(','.join(bad))")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                            check=False, timeout=60)
    assert result.returncode == 0, result.stderr
    assert "torch" not in result.stdout.split(","), f"{module} pulls in torch"
    assert "matplotlib" not in result.stdout.split(","), f"{module} pulls in matplotlib"


def test_kernel_imports_no_product_package():
    code = ("import sys, ft_launch.config, ft_launch.errors, ft_launch.events, ft_launch.files, "
            "ft_launch.ids, ft_launch.logs, ft_launch.slurm.client; "
            "print(sorted({'.'.join(m.split('.')[:2]) for m in sys.modules} & "
            "{'ft_launch.launcher', 'ft_launch.ftar', 'ft_launch.ckpt', 'ft_launch.health', "
            "'ft_launch.slurm_plugins'}))")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                            check=False, timeout=60)
    assert result.stdout.strip() == "[]", result.stdout + result.stderr
