"""Everything but ``ckpt.torch_state`` loads without torch (the controller imports these)."""

import subprocess
import sys

import pytest

TORCH_FREE = ["ckpt.manifest", "ckpt.placement", "ckpt.wire", "ckpt.dual", "ckpt.snapshot",
              "ckpt.serve", "ckpt.fetch", "ckpt.backup", "ckpt.persist",
              "ckpt.restore", "ckpt.rank"]


@pytest.mark.timeout(60)
def test_checkpoint_modules_do_not_import_torch():
    code = (f"import sys, {', '.join(TORCH_FREE)}; "
            "print('torch' in sys.modules)")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                            check=False, timeout=60)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "False"
