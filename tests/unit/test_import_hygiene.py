"""The controller, CLI and Slurm plugins must start fast: they never import torch, nor
matplotlib (the optional ``[plot]`` extra, imported only when a figure is drawn)."""

import subprocess
import sys

import pytest

CONTROL_PLANE = ["ftcore.config", "ftcore.errors", "ftcore.events", "ftcore.slurm.client",
                 "ftcore.slurm.parse", "launcher.cli", "launcher.plan", "launcher.supervisor",
                 "launcher.recovery", "launcher.standby",
                 "launcher.quorum", "launcher.worker.manager", "launcher.versions",
                 "launcher.reporting.summary", "launcher.reporting.status",
                 "launcher.reporting.live", "launcher.reporting.timeline",
                 "launcher.reporting.plots"]


@pytest.mark.parametrize("module", CONTROL_PLANE)
def test_module_does_not_import_torch(module):
    code = (f"import sys, {module}; "
            "bad = [m for m in ('torch', 'numpy.testing', 'matplotlib') if m in sys.modules]; "
            "print(','.join(bad))")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=False,
                            timeout=60)
    assert result.returncode == 0, result.stderr
    assert "torch" not in result.stdout.split(","), f"{module} pulls in torch"
    assert "matplotlib" not in result.stdout.split(","), f"{module} pulls in matplotlib"


def test_kernel_imports_no_product_package():
    code = ("import sys, ftcore.config, ftcore.errors, ftcore.events, ftcore.files, ftcore.ids, "
            "ftcore.logs, ftcore.slurm.client; "
            "print(sorted({m.split('.')[0] for m in sys.modules} & "
            "{'launcher', 'ftar', 'ckpt', 'health', 'slurm_plugins'}))")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=False,
                            timeout=60)
    assert result.stdout.strip() == "[]", result.stdout + result.stderr
