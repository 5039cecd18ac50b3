"""The warm standby agent: one job step per standby node.

    python -m ft_launch.launcher.controller.standby --run-dir DIR --node NODE -- python train.py

The controller starts it behind the step-level health gate (``python -m
ft_launch.slurm_plugins.gate -- python -m ft_launch.launcher.controller.standby ...``), so
it runs only on a node that passed the gate's checks. It imports what the training
script needs (torch: seconds saved at promotion), writes ``standby/NODE.ready``
and then waits, cheaply, for ``standby/NODE.activate`` (written atomically by
the controller, naming the replica to become). On activation it runs the gate's
checks once more (a failure: ``standby/NODE.unhealthy`` and exit 76, so the
controller evicts the node and promotes the next standby), then runs the
training script *in this process* (so the imports stay warm) as that replica.
The wait is bounded by the step: the controller cancels unused standbys.
"""

from __future__ import annotations

import argparse
import ast
import importlib
import json
import logging
import os
import runpy
import sys
import time
from collections.abc import Mapping
from pathlib import Path

from ft_launch.errors import ExitCode, FtError
from ft_launch.files import atomic_write_text
from ft_launch.launcher.worker.identity import ENV_REPLICA_ID, task_world_env
from ft_launch.logs import configure_logging

log = logging.getLogger("ft_launch.launcher.controller.standby")
POLL_INTERVAL = 0.02


def standby_dir(run_dir: Path) -> Path:
    return run_dir / "standby"


def activation_file(run_dir: Path, node: str) -> Path:
    return standby_dir(run_dir) / f"{node}.activate"


def ready_file(run_dir: Path, node: str) -> Path:
    return standby_dir(run_dir) / f"{node}.ready"


def unhealthy_file(run_dir: Path, node: str) -> Path:
    return standby_dir(run_dir) / f"{node}.unhealthy"


def activate(run_dir: Path, node: str, env: dict[str, str],
             command: tuple[str, ...] | None = None) -> None:
    """Controller side: hand ``node``'s agent its replica identity (and the command to
    run, when it differs from the one the agent was warmed for)."""
    order: dict[str, object] = {"env": env}
    if command is not None:
        order["command"] = list(command)
    atomic_write_text(activation_file(run_dir, node), json.dumps(order))


def recheck(env: Mapping[str, str]) -> str | None:
    """The gate's checks again, at promotion, on this node (``env``: the step's
    environment): None when healthy, else the reason."""
    # Imported here, as late as the check: the agent's start is for the script's imports.
    from ft_launch.health.gate import check_node
    from ft_launch.health.settings import load_settings

    try:
        failure = check_node(load_settings(env=env), env).failure
    except FtError as error:
        return f"health gate could not run: {error}"
    return None if failure is None else f"health gate failed at promotion: {failure.reason}"


def is_python(command: list[str]) -> bool:
    return bool(command) and Path(command[0]).name.startswith("python") and len(command) > 1 \
        and command[1].endswith(".py")


#: imported lazily by most FSDP2 training scripts (the first ``fully_shard`` pulls in
#: DTensor, and its first call dynamo: seconds of a promotion otherwise), and the
#: worker runtime
WARM_MODULES = ("torch", "torch.distributed", "torch.distributed.fsdp",
                "torch.distributed.tensor", "torch._dynamo", "ft_launch.launcher.worker.torch_api")


def script_imports(script: Path) -> list[str]:
    """The absolute modules ``script`` imports at its top level, found by parsing it
    (never running it): importing them later finds them already loaded."""
    try:
        tree = ast.parse(script.read_bytes(), filename=str(script))
    except (OSError, SyntaxError, ValueError):
        return []           # the script itself will say what is wrong when it runs
    names: list[str] = []
    for node in tree.body:
        if isinstance(node, ast.Import):
            names.extend(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names.append(node.module)
    return names


def warm_up(command: list[str]) -> None:
    """Import what a PyTorch training script imports (the slow part of a start): the
    usual torch modules and the script's own top-level imports. The script's folder
    goes first on the path, as ``python script.py`` puts it."""
    if not is_python(command):
        return
    script = Path(command[1])
    sys.path.insert(0, str(script.resolve().parent))
    for name in (*WARM_MODULES, *script_imports(script)):
        try:
            importlib.import_module(name)
        except Exception as error:  # noqa: BLE001  (the script meets it again, and says so)
            log.info("standby: could not import %s ahead of the script: %s", name, error)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m ft_launch.launcher.controller.standby",
                                     description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--run-dir", type=Path, required=True)
    parser.add_argument("--node", required=True)
    parser.add_argument("command", nargs=argparse.REMAINDER)
    args = parser.parse_args(argv)
    configure_logging("INFO")
    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    started = time.monotonic()
    warm_up(command)
    atomic_write_text(ready_file(args.run_dir, args.node),
                      json.dumps({"warm_s": time.monotonic() - started, "pid": os.getpid()}))
    log.info("standby %s warm after %.2f s; waiting for activation", args.node,
             time.monotonic() - started)
    activation = activation_file(args.run_dir, args.node)
    while not activation.exists():
        time.sleep(POLL_INTERVAL)  # an idle wait for an external event, cancelled by scancel
    order = json.loads(activation.read_text())
    os.environ.update(order["env"])
    os.environ.update(task_world_env(os.environ))   # the replica's torch world, this task
    log.info("standby %s promoted to replica %s", args.node,
             order["env"].get(ENV_REPLICA_ID, "?"))
    # The node passed the gate when this agent started, maybe hours ago: check again
    # before it becomes a replica (a failure here costs one more promotion, not a job).
    unhealthy = recheck(os.environ)
    if unhealthy is not None:
        log.error("standby %s not promoted: %s", args.node, unhealthy)
        atomic_write_text(unhealthy_file(args.run_dir, args.node), unhealthy)
        return ExitCode.NODE_UNHEALTHY
    command = list(order.get("command") or command)   # a hot update may have changed it
    if is_python(command):
        sys.argv = command[1:]
        runpy.run_path(command[1], run_name="__main__")
        return ExitCode.OK
    os.execvp(command[0], command)
    return ExitCode.FATAL_NO_REQUEUE  # not reached


if __name__ == "__main__":
    sys.exit(main())
