"""What the controller and the plugins import must stay torch-free (and the
plugins numpy-free: they start on every job)."""

import subprocess
import sys

import pytest

TORCH_FREE = ["health.catalog", "health.settings", "health.inspection", "health.monitor",
              "health.aggregation", "health.tracer", "health.replay", "health.replay_runner",
              "health.alignment", "health.events", "slurm_plugins.hook"]


@pytest.mark.parametrize("module", TORCH_FREE)
def test_module_does_not_import_torch(module):
    code = f"import sys, {module}; print('torch' in sys.modules)"
    done = subprocess.run([sys.executable, "-c", code], check=False, capture_output=True, text=True,
                          timeout=60)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "False", f"{module} pulls in torch"


def test_health_imports_no_launcher_package():
    code = ("import sys, health.settings, health.monitor, health.tracer, slurm_plugins.gate; "
            "print(sorted({m.split('.')[0] for m in sys.modules} & "
            "{'launcher', 'ftar', 'ckpt'}))")
    done = subprocess.run([sys.executable, "-c", code], check=False, capture_output=True, text=True,
                          timeout=60)
    assert done.stdout.strip() == "[]", done.stdout + done.stderr
