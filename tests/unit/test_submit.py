"""``ft-launch submit``'s pure parts, and that bad input stops it before any salloc."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from ft_launch.config import load_config
from ft_launch.launcher.cli import build_parser
from ft_launch.launcher.controller.submit import controller_argv, nodes_needed, salloc_extra


def parse(*argv: str):
    return build_parser().parse_args(["submit", *argv])


def test_the_allocation_holds_the_replicas_and_standby_nodes_only():
    config = load_config(None, overrides=["job.replicas=3", "job.nodes_per_replica=2",
                                          "job.standby=1"])
    assert nodes_needed(config) == 7     # no node for a batch host: there is none


def test_salloc_gets_the_site_options_as_given():
    args = parse("--time", "1-00:00:00", "--partition", "gpu", "--salloc-arg=--qos=high",
                 "--", "python", "t.py")
    assert salloc_extra(args) == ("--time=1-00:00:00", "--partition=gpu", "--qos=high")


def test_the_detached_controller_runs_the_same_config_and_releases_the_allocation(tmp_path):
    config = tmp_path / "ftl.toml"
    args = build_parser().parse_args(["--config", str(config), "--set", "quorum.join_timeout=3",
                                      "submit", "--replicas", "2", "--standby", "1", "--",
                                      "python", "train.py", "--steps", "9"])
    argv = controller_argv(args, "42", ("python", "train.py", "--steps", "9"))
    assert argv[1:3] == ["-m", "ft_launch.launcher.cli"]
    assert argv[argv.index("--config") + 1] == str(config.resolve())
    assert argv[argv.index("--set") + 1] == "quorum.join_timeout=3"
    run = argv.index("run")
    assert argv[run:run + 4] == ["run", "--jobid", "42", "--release-allocation"]
    assert argv[argv.index("--replicas") + 1] == "2" and argv[argv.index("--standby") + 1] == "1"
    assert argv[argv.index("--"):] == ["--", "python", "train.py", "--steps", "9"]


def test_bad_input_is_refused_before_anything_is_allocated(tmp_path):
    # salloc on PATH records that it ran: it must not be reached
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    marker = tmp_path / "salloc-ran"
    salloc = bin_dir / "salloc"
    salloc.write_text(f"#!/bin/sh\ntouch {marker}\nexit 1\n")
    salloc.chmod(0o755)
    env = {"PATH": f"{bin_dir}:/usr/bin:/bin"}
    for argv in (["submit", "--replicas", "0", "--", "python", "t.py"],
                 ["submit", "--replicas", "2"]):
        result = subprocess.run([sys.executable, "-m", "ft_launch.launcher.cli", *argv], env=env,
                                cwd=Path(__file__).resolve().parents[2], capture_output=True,
                                text=True, timeout=60, check=False)
        assert result.returncode == 2, result.stderr
        assert result.stderr.startswith("ft-launch: error:") and "Traceback" not in result.stderr
    assert not marker.exists()
