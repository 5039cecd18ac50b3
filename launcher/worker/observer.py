"""The step observer: the one seam through which something outside the step protocol
watches a rank's steps at fixed points, and may alter them. Production runs the
no-op ``StepObserver``; fault drills run another (the tests, the demo and the
benchmarks: ``tests/faults/injector.py``; ``ft-launch local --kill``: ``local``).

``FTL_WORKER_OBSERVER`` names the observer a worker loads when it starts
(``load_observer``), only when set:

* ``PATH.py[:NAME]``: a Python file, loaded as it is (the tests' fault injector is
  one: the workers run the installed package, without the checkout on their path);
* ``MODULE[:NAME]``: an importable module.

``NAME`` (default ``step_observer``) is a callable ``(config, identity)`` that returns
the observer (a ``StepObserver``).
"""

from __future__ import annotations

import importlib
import importlib.util
import os
import sys
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ft_launch.env import ENV_INJECT, ENV_OBSERVER
from ft_launch.errors import UsageError

if TYPE_CHECKING:
    from ft_launch.config import Config

    from .identity import WorkerIdentity

#: What a ``FTL_WORKER_OBSERVER`` target defines unless it names another callable.
DEFAULT_FACTORY = "step_observer"

#: Applied to each gradient tensor of one reduction, in place, before it is averaged.
AlterGradients = Callable[[Any], None]


class StepObserver:
    """The points of a rank's step, in the order a step reaches them; each does nothing
    here (what production runs). An observer overrides the ones it needs. Each runs on
    the training thread unless it says otherwise; what it raises there fails the
    training script as an exception of the step would, and on the exchange thread it
    is raised again in the training thread when that waits (``exchange``)."""

    def attach(self, model: Any) -> None:
        """The training script's model, once, before its first step (a torch module,
        from ``ft_manager``; in a replay too): an observer may hook it."""

    def step_started(self, step: int) -> None:
        """The quorum answered for ``step`` and the ring is ready; the step's
        contribution all-reduce is next (exchange thread)."""

    def gradients(self, step: int) -> AlterGradients | None:
        """A reduction of ``step``'s gradients starts (exchange thread): what to do to
        each of its gradient tensors before they are averaged, or None."""
        return None

    def mid_allreduce(self, step: int) -> None:
        """Between the reduce-scatter and the all-gather of one of ``step``'s gradient
        all-reduces (exchange thread)."""

    def before_commit(self, step: int) -> None:
        """``step``'s gradients are averaged; the replica's commit vote is not cast yet."""

    def after_commit(self, step: int) -> None:
        """``step`` committed: the optimizer stepped, its commit event is written."""

    def loss(self, step: int, loss: float) -> float:
        """The loss that ``step``'s commit event reports (this rank's, as given)."""
        return loss


def load_observer(config: Config, identity: WorkerIdentity) -> StepObserver:
    """The observer ``FTL_WORKER_OBSERVER`` names (module doc); the no-op one when it
    names none. Faults asked for (``FTL_WORKER_INJECT``) with no observer to inject
    them are an error, not a drill that silently does nothing."""
    spec = os.environ.get(ENV_OBSERVER, "")
    if not spec:
        if os.environ.get(ENV_INJECT):
            raise UsageError(f"{ENV_INJECT} is set, but no step observer injects its faults",
                             hint=f"set {ENV_OBSERVER} to the fault injector of the "
                                  "checkout's tests: <checkout>/tests/faults/injector.py")
        return StepObserver()
    observer = _factory(spec)(config, identity)
    if not isinstance(observer, StepObserver):
        raise UsageError(f"{ENV_OBSERVER}={spec} made a {type(observer).__name__}, "
                         "not a StepObserver",
                         hint="its callable returns a subclass of "
                              "ft_launch.launcher.worker.observer.StepObserver")
    return observer


def _factory(spec: str) -> Callable[[Config, WorkerIdentity], Any]:
    target, colon, name = spec.rpartition(":")
    if not colon or not name.isidentifier():
        target, name = spec, DEFAULT_FACTORY
    hint = (f"{ENV_OBSERVER} is PATH.py[:NAME] or MODULE[:NAME], NAME a callable "
            f"(config, identity) -> StepObserver ({DEFAULT_FACTORY} unless named)")
    try:
        module = _load_file(Path(target)) if target.endswith(".py") else \
            importlib.import_module(target)
    except (ImportError, OSError) as error:
        raise UsageError(f"{ENV_OBSERVER}={spec}: cannot load {target}: {error}",
                         hint=hint) from error
    factory = getattr(module, name, None)
    if not callable(factory):
        raise UsageError(f"{ENV_OBSERVER}={spec}: {target} has no callable {name}", hint=hint)
    return factory


def _load_file(path: Path) -> Any:
    name = f"ftl_observer_{path.stem}"
    spec = importlib.util.spec_from_file_location(name, path)
    if spec is None or spec.loader is None:
        raise ImportError(f"not a Python file: {path}")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module      # its dataclasses look their module up there
    try:
        spec.loader.exec_module(module)
    except BaseException:
        del sys.modules[name]
        raise
    return module
