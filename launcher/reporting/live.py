"""The status view, live: one view that updates in place in a terminal (rich's
``Live``): a progress bar per replica (state, step, steps/s), the standby pool,
the latest events, one line each.

``status_view`` is pure (a ``RunStatus`` in, a rich renderable out). ``StatusDisplay``
refreshes it from a run directory. When the console is not a terminal (a pipe, a
log file) it prints plain text instead: the status once, then each new event as a
line and a progress line now and then, never the whole view again.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path
from types import TracebackType
from typing import Self

from rich.console import Console, Group, RenderableType
from rich.live import Live
from rich.panel import Panel
from rich.progress_bar import ProgressBar
from rich.table import Table
from rich.text import Text

from .status import RunStatus, StatusReader, event_line, status_text, witness_text
from .timeline import STATE_COLOURS, BandState

REFRESH_INTERVAL = 1.0          # s between reads of the run directory
PLAIN_PROGRESS_INTERVAL = 30.0  # s between progress lines when not on a terminal
BAR_WIDTH = 24


def status_view(status: RunStatus, total_steps: int | None = None) -> RenderableType:
    """The run at a glance. Bars fill to ``total_steps`` when known, else to the
    leading replica's step (so a replica that is behind shows it)."""
    total = max(total_steps or status.leading_step + 1, 1)
    title = Text.assemble(("run ", "bold"), (status.run_dir.name, "bold"))
    if status.started is not None:
        title.append(f"  {_clock(status.now - status.started)}")
    if status.finished is not None:
        title.append(f"  finished, exit {status.finished.exit_code}: "
                     f"{status.finished.reason}",
                     "green" if status.finished.exit_code == 0 else "red")
    table = Table.grid(padding=(0, 2))
    for justify in ("left", "left", "left", "left", "right", "right", "left"):
        table.add_column(justify=justify, no_wrap=True)
    for r in status.replicas:
        colour = STATE_COLOURS[r.state]
        done = (r.step + 1) if r.step is not None else 0
        table.add_row(
            Text(f"replica {r.replica_id}", "bold"), Text(",".join(r.nodes) or "?"),
            Text(r.state.value, colour),
            ProgressBar(total=total, completed=min(done, total), width=BAR_WIDTH,
                        complete_style=colour, finished_style=colour),
            Text(f"step {r.step if r.step is not None else '-'}"
                 + (f"/{total_steps}" if total_steps else "")),
            Text(f"{r.steps_per_s:.2f} steps/s", "dim" if r.state is not
                 BandState.TRAINING else ""),
            Text(f"{r.how}" + (f", {r.contributors} contributing"
                               if r.contributors is not None else ""), "dim"))
    standby = Text.assemble(("standby  ", "bold"), "warm: ",
                            (", ".join(status.standby.warm) or "-", "cyan"), "   promoted: ",
                            (", ".join(status.standby.promoted) or "-", "magenta"))
    if status.witness is not None:
        standby.append(Text.assemble("\n", ("witness  ", "bold"), witness_text(status.witness),
                                     style="" if status.witness.voting else "yellow"))
    events = [Text(event_line(e, status.started), "dim" if i < len(status.recent) - 1 else "",
                   no_wrap=True, overflow="ellipsis") for i, e in enumerate(status.recent)]
    return Panel(Group(table, Text(""), standby, Text(""), Text("events", "bold"), *events),
                 title=title, title_align="left", subtitle=Text(str(status.run_dir), "dim"),
                 subtitle_align="right", border_style="grey50", expand=False)


def _clock(seconds: float) -> str:
    minutes, seconds = divmod(int(seconds), 60)
    return f"{minutes // 60}:{minutes % 60:02d}:{seconds:02d}"


class StatusDisplay:
    """Show a run's status on ``console`` until closed: ``refresh()`` reads the run
    directory again; ``note(text)`` prints a line above the view."""

    def __init__(self, run_dir: Path, console: Console, *, total_steps: int | None = None,
                 recent: int = 6, clock: Callable[[], float] = time.time) -> None:
        self.console = console
        self.total_steps = total_steps
        self.clock = clock
        self._reader = StatusReader(run_dir, recent)
        self._live: Live | None = None
        self._events_shown = 0
        self._last_progress = -PLAIN_PROGRESS_INTERVAL
        self.status: RunStatus | None = None

    def __enter__(self) -> Self:
        status = self._read()
        if self.console.is_terminal:
            # Redrawn on refresh() only; prints elsewhere land above the view.
            self._live = Live(status_view(status, self.total_steps), console=self.console,
                              auto_refresh=False)
            self._live.start(refresh=True)
        else:
            self.console.out(status_text(status), end="", highlight=False)
            self._events_shown = len(self._reader.new_events(0))
            self._last_progress = self.clock()
        return self

    def __exit__(self, kind: type[BaseException] | None, error: BaseException | None,
                 trace: TracebackType | None) -> None:
        if self._live is not None:
            self._live.stop()       # the last view stays on the screen
        elif self.status is not None:
            self.console.out(status_text(self.status), end="", highlight=False)

    def refresh(self) -> RunStatus:
        status = self._read()
        if self._live is not None:
            self._live.update(status_view(status, self.total_steps), refresh=True)
            return status
        for event in self._reader.new_events(self._events_shown):
            self.console.out(event_line(event, status.started), highlight=False)
            self._events_shown += 1
        if self.clock() - self._last_progress >= PLAIN_PROGRESS_INTERVAL:
            self._last_progress = self.clock()
            self.console.out(progress_line(status), highlight=False)
        return status

    def note(self, text: str) -> None:
        if self._live is not None:
            self._live.console.print(text, highlight=False, markup=False)
        else:
            self.console.out(text, highlight=False)

    def _read(self) -> RunStatus:
        self.status = self._reader.read(self.clock())
        return self.status


def progress_line(status: RunStatus) -> str:
    """``steps: replica 0 412 (3.10/s, training), ...``: the plain form of the bars."""
    return "    steps: " + ", ".join(
        f"replica {r.replica_id} {r.step if r.step is not None else '-'} "
        f"({r.steps_per_s:.2f}/s, {r.state.value})" for r in status.replicas)


def show(run_dir: Path, console: Console | None = None, *,
         total_steps: int | None = None) -> RunStatus:
    """``ft-launch status``: the view once (plain text when not on a terminal)."""
    console = console or Console()
    status = StatusReader(run_dir).read(time.time())
    if console.is_terminal:
        console.print(status_view(status, total_steps))
    else:
        console.out(status_text(status), end="", highlight=False)
    return status


def watch(run_dir: Path, console: Console | None = None, *,
          interval: float = REFRESH_INTERVAL, total_steps: int | None = None) -> RunStatus:
    """``ft-launch status --watch``: the live view until the run finishes (or Ctrl-C)."""
    with StatusDisplay(run_dir, console or Console(), total_steps=total_steps) as display:
        status = display.refresh()
        try:
            while status.finished is None:
                time.sleep(interval)        # the refresh period, not a wait for an event
                status = display.refresh()
        except KeyboardInterrupt:
            pass
    return status
