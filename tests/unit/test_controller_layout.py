"""The controller's two maps stay exact: the index of its events and actions (the
docstring of ``ft_launch.launcher.controller``) and the worker contract (the modules of
``ft_launch.launcher.worker`` it reads, named in that package's docstring)."""

from __future__ import annotations

import ast
import importlib
import pkgutil
import re
import typing
from pathlib import Path

from ft_launch.events import Event as Record
from ft_launch.launcher import controller, worker
from ft_launch.launcher.controller import lifecycle_model, recovery, versions

PACKAGE = controller.__name__
#: an index row: ``module.Class``, then what it is
ROW = re.compile(r"^\s+``(\w+)\.(\w+)``\s{2,}\S")
#: every union of events or actions a rule table takes or returns
UNIONS = (lifecycle_model.Event, lifecycle_model.Order, recovery.RecoveryEvent,
          recovery.RecoveryAction, versions.VersionEvent, versions.VersionAction)


def controller_modules() -> list[str]:
    return [f"{PACKAGE}.{m.name}" for m in pkgutil.iter_modules(controller.__path__)]


def index_sections() -> list[tuple[str, set[tuple[str, str]]]]:
    """(heading, its rows as (module, class)) for each section of the index."""
    text = controller.__doc__.split("Index of its events and actions", 1)[1]
    sections: list[tuple[str, set[tuple[str, str]]]] = []
    heading: list[str] = []
    for line in text.splitlines():
        row = ROW.match(line)
        if row:
            if heading:
                sections.append((" ".join(heading), set()))
                heading = []
            sections[-1][1].add(row.groups())
        elif line.strip():
            heading.append(line.strip())
    return sections


def named(classes) -> set[tuple[str, str]]:
    return {(c.__module__.rsplit(".", 1)[1], c.__name__) for c in classes}


def records_defined_here() -> set[type]:
    """Every ``ft_launch.events.Event`` class a controller module defines."""
    for module in controller_modules():
        importlib.import_module(module)
    found, todo = set(), [Record]
    while todo:
        for sub in todo.pop().__subclasses__():
            todo.append(sub)
            if sub.__module__.startswith(PACKAGE + "."):
                found.add(sub)
    return found


def test_the_index_lists_every_event_and_action_class_with_its_module():
    in_unions = {c for union in UNIONS for c in typing.get_args(union) if c is not Record}
    expected = named(in_unions | records_defined_here())
    listed = [row for _, rows in index_sections() for row in rows]
    assert len(listed) == len(set(listed)), "a class is listed twice"
    assert set(listed) == expected, (f"missing from the index: {sorted(expected - set(listed))}; "
                                     f"listed but not there: {sorted(set(listed) - expected)}")


def test_the_decisions_inputs_and_orders_are_listed_under_their_unions():
    sections = dict(index_sections())
    (events,) = [rows for heading, rows in sections.items()
                 if "``lifecycle_model.Event``" in heading]
    (orders,) = [rows for heading, rows in sections.items()
                 if "``lifecycle_model.Order``" in heading]
    assert events == named(typing.get_args(lifecycle_model.Event))
    assert orders == named(typing.get_args(lifecycle_model.Order))


def worker_modules_imported(path: Path, module: str) -> set[str]:
    """The ``ft_launch.launcher.worker`` modules ``module`` (at ``path``) imports."""
    package = module.rsplit(".", 1)[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parent = package.rsplit(".", node.level - 1)[0] if node.level > 1 else package
                base = f"{parent}.{base}" if base else parent
            names = [base] if base != worker.__name__ else \
                [f"{base}.{alias.name}" for alias in node.names]
        elif isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        else:
            continue
        found |= {n for n in names if n.startswith(worker.__name__ + ".")}
    return {n.split(".")[3] for n in found}


def test_the_controller_reads_the_workers_only_through_the_named_contract():
    imported = set()
    for module in controller_modules():
        path = Path(controller.__path__[0]) / f"{module.rsplit('.', 1)[1]}.py"
        imported |= worker_modules_imported(path, module)
    contract = worker.__doc__.split("The worker contract", 1)[1].split("\n\n")[1]
    named_contract = set(re.findall(r"^\* ``(\w+)``:", contract, flags=re.MULTILINE))
    assert imported == named_contract
