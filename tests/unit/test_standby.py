"""The warm standby agent's warm-up: what it imports before a promotion."""

from __future__ import annotations

import sys
from pathlib import Path

from ft_launch.launcher.standby import script_imports, warm_up


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
