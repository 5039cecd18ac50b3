"""Everything but ``ft_launch.ckpt.torch_state`` loads without torch (the controller imports
these)."""

import subprocess
import sys

import pytest

TORCH_FREE = ["ft_launch.ckpt.manifest", "ft_launch.ckpt.placement", "ft_launch.ckpt.wire",
              "ft_launch.ckpt.dual", "ft_launch.ckpt.snapshot", "ft_launch.ckpt.serve",
              "ft_launch.ckpt.fetch", "ft_launch.ckpt.backup", "ft_launch.ckpt.persist",
              "ft_launch.ckpt.restore", "ft_launch.ckpt.rank"]


@pytest.mark.timeout(60)
def test_checkpoint_modules_do_not_import_torch():
    code = (f"import sys, {', '.join(TORCH_FREE)}; "
            "print('torch' in sys.modules)")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                            check=False, timeout=60)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "False"
