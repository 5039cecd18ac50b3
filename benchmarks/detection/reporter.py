"""The training side of detection: each rank reports its step metrics and a
heartbeat (from a thread, so a rank blocked in a collective still proves it is
alive, while a killed or stopped one falls silent)."""

from __future__ import annotations

import threading

from ft_launch.health.channel import Sender
from ft_launch.health.wire import MessageKind, new_sender_id, write_number


class MetricsReporter:
    def __init__(self, endpoint: str, secret: str, rank: int, *,
                 heartbeat_interval: float = 0.5) -> None:
        self.rank = rank
        self.heartbeat_interval = heartbeat_interval
        # send_timeout 0: training never waits for the controller.
        self.sender = Sender(endpoint, secret, new_sender_id(f"rank:{rank}"), send_timeout=0)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._heartbeats, name=f"heartbeat-{rank}",
                                        daemon=True)

    def start(self) -> MetricsReporter:
        self._thread.start()
        return self

    def report_step(self, step: int, loss: float, *, grad_norm: float | None = None,
                    step_time: float | None = None, tokens: int | None = None) -> None:
        self.sender.send(MessageKind.METRICS, {
            "rank": self.rank, "step": step, "loss": write_number(loss),
            "grad_norm": write_number(grad_norm), "step_time": write_number(step_time),
            "tokens": tokens})

    def _heartbeats(self) -> None:
        while not self._stop.is_set():
            self.sender.send(MessageKind.HEARTBEAT, {"rank": self.rank})
            self._stop.wait(self.heartbeat_interval)  # the heartbeat period

    def close(self) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(2 * self.heartbeat_interval + 1)
        self.sender.close()
