"""What the controller and the plugins import must stay torch-free (and the
plugins numpy-free: they start on every job)."""

import subprocess
import sys

import pytest

TORCH_FREE = ["ft_launch.health.catalog", "ft_launch.health.settings",
              "ft_launch.health.inspection", "ft_launch.health.aggregation",
              "ft_launch.health.replay", "ft_launch.health.replay_runner",
              "ft_launch.health.alignment", "ft_launch.health.gate",
              "ft_launch.slurm_plugins.hook", "ft_launch.slurm_plugins.gate"]


@pytest.mark.parametrize("module", TORCH_FREE)
def test_module_does_not_import_torch(module):
    code = f"import sys, {module}; print('torch' in sys.modules)"
    done = subprocess.run([sys.executable, "-c", code], check=False, capture_output=True, text=True,
                          timeout=60)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "False", f"{module} pulls in torch"


def test_health_imports_no_launcher_package():
    code = ("import sys, ft_launch.health.settings, ft_launch.health.aggregation, "
            "ft_launch.health.gate, ft_launch.slurm_plugins.gate; "
            "print(sorted({'.'.join(m.split('.')[:2]) for m in sys.modules} & "
            "{'ft_launch.launcher', 'ft_launch.ftar', 'ft_launch.ckpt'}))")
    done = subprocess.run([sys.executable, "-c", code], check=False, capture_output=True, text=True,
                          timeout=60)
    assert done.stdout.strip() == "[]", done.stdout + done.stderr


def test_checks_never_load_the_simulation():
    """Injected faults reach the checks only through the host facts and the GPU backend
    the settings choose: the checks and their context do not know the simulation."""
    code = ("import sys, ft_launch.health.catalog, ft_launch.health.profile; "
            "print('ft_launch.health.simulation' in sys.modules)")
    done = subprocess.run([sys.executable, "-c", code], check=False, capture_output=True, text=True,
                          timeout=60)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "False", "a check module imports health.simulation"
