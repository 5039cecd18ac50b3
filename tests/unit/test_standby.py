"""The warm standby agent: what it imports before a promotion (its warm-up), and the
health gate's check it runs again when promoted (simulated GPUs)."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

from ft_launch.launcher.controller.standby import recheck, script_imports, warm_up


def test_script_imports_are_the_absolute_top_level_ones(tmp_path: Path) -> None:
    script = tmp_path / "train.py"
    script.write_text("\n".join([
        "import os, json as j",
        "from collections import abc",
        "from . import sibling",              # relative: not importable ahead of the script
        "def main():",
        "    import secrets",                 # inside a function: runs only if called
        "if True:",
        "    import glob",                    # conditional: left to the script
        "import xml.dom",
    ]))
    assert script_imports(script) == ["os", "json", "collections", "xml.dom"]


def test_a_script_that_does_not_parse_warms_nothing_of_its_own(tmp_path: Path) -> None:
    script = tmp_path / "broken.py"
    script.write_text("import os\ndef (:\n")
    assert script_imports(script) == []
    assert script_imports(tmp_path / "missing.py") == []


def test_warm_up_imports_the_scripts_sibling_modules_from_its_folder(tmp_path: Path,
                                                                     monkeypatch) -> None:
    name = f"ftl_warm_sibling_{tmp_path.name}".replace("-", "_")
    (tmp_path / f"{name}.py").write_text("LOADED = True\n")
    (tmp_path / "train.py").write_text(f"import {name}\nimport ftl_no_such_module_anywhere\n")
    monkeypatch.setattr(sys, "path", list(sys.path))
    monkeypatch.delitem(sys.modules, name, raising=False)
    warm_up([sys.executable, str(tmp_path / "train.py")])   # the missing one is only logged
    assert sys.modules[name].LOADED is True
    assert sys.path[0] == str(tmp_path.resolve())
    assert "torch.distributed.fsdp" in sys.modules


def test_a_command_that_is_not_a_python_script_is_not_warmed(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.setattr(sys, "path", list(sys.path))
    before = list(sys.path)
    warm_up(["bash", str(tmp_path / "train.sh")])
    assert sys.path == before


def simulated_node(tmp_path: Path, *faults: dict) -> dict[str, str]:
    """The environment of a standby's step on node n3 with simulated GPUs (and ``faults``)."""
    fault_dir = tmp_path / "faults"
    fault_dir.mkdir()
    (fault_dir / "n3.json").write_text(json.dumps(list(faults)))
    config = tmp_path / "health.toml"
    config.write_text(f'[health]\ngpus_per_node = 8\nbackend = "simulated"\n'
                      f'sim_fault_dir = "{fault_dir}"\n')
    return {"PATH": os.environ["PATH"], "FTL_CONFIG": str(config), "SLURMD_NODENAME": "n3",
            "SLURM_JOB_ID": "45"}


def test_the_check_at_promotion_passes_a_healthy_node(tmp_path: Path) -> None:
    assert recheck(simulated_node(tmp_path)) is None


def test_the_check_at_promotion_names_what_went_bad_since_the_gate(tmp_path: Path) -> None:
    env = simulated_node(tmp_path, {"gpu": 6, "nvlink_down": [1]})
    assert recheck(env) == "health gate failed at promotion: gpu6 nvlink1 down"


def test_the_check_at_promotion_says_when_it_cannot_run(tmp_path: Path) -> None:
    reason = recheck({**simulated_node(tmp_path), "SLURMD_NODENAME": "../x"})
    assert reason is not None and reason.startswith("health gate could not run: ")
    assert "not a Slurm node name" in reason
