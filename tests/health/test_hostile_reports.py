"""Hostile or broken peers on the health channel: a secret holder's malformed
messages, floods of junk and oversize frames reach the controller as counted
drops, never as an exception out of ``NodeInspection.alarms()``, memory held
for them, or a log line each."""

from __future__ import annotations

import json
import logging
import math
import os
import subprocess
import threading
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import psutil
import pytest
import zmq
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from benchmarks.detection.monitor import DetectionMonitor
from ft_launch.config import HealthConfig
from ft_launch.health.channel import Collector, Sender
from ft_launch.health.inspection import SECRET_ENV, node_alarm, report_from
from ft_launch.health.settings import ENV_CONFIG
from ft_launch.health.wire import (
    MAX_FRAME_BYTES,
    PROTOCOL,
    Envelope,
    MessageKind,
    WireError,
    decode,
    encode,
)
from ft_launch.ids import new_job_secret, sign
from ft_launch.launcher.controller.inspection import NodeInspection
from ft_launch.logs import SAMPLE_EVERY
from tests.waiting import wait_until
from tests.zmtp import RawPeer

pytestmark = pytest.mark.timeout(120)

HEALTHY_REPORT = {"profile": "inspection", "node": "n2", "status": "pass", "started": 1.0,
                  "duration": 0.1, "results": [{"name": "gpu_xid", "status": "pass",
                                                "reason": "ok", "evidence": {}}]}
FAILING_RESULT = {"name": "gpu_xid", "status": "fail", "reason": "gpu5 xid 94", "evidence": {}}


def report(**changes: Any) -> dict[str, Any]:
    return {**HEALTHY_REPORT, "status": "fail", "results": [FAILING_RESULT], **changes}


def signed(secret: str, kind: bytes, body: bytes) -> list[bytes]:
    """Frames carrying ``body`` exactly as written, signed as ``encode`` signs."""
    return [PROTOCOL, kind, body, sign(secret, PROTOCOL, kind, body)]


def envelope_frames(secret: str, kind: MessageKind, body: Any, *, sender: Any = "agent:n2/1/a",
                    seq: Any = 1, sent: Any = 1.0) -> list[bytes]:
    """Any field values, through the real encoder (``json.dumps`` writes inf as Infinity)."""
    return encode(secret, Envelope(kind, sender, seq, sent, body))


def hostile_messages(secret: str) -> dict[str, list[bytes]]:
    """Signed with the job secret, each wrong in one way; all claim node n2 failed."""
    e, r, m, h = envelope_frames, MessageKind.REPORT, MessageKind.METRICS, MessageKind.HEARTBEAT
    return {
        "seq Infinity": e(secret, r, report(), seq=math.inf),
        "seq NaN": e(secret, r, report(), seq=math.nan, sender="b/1/a"),
        "seq a string": e(secret, r, report(), seq="\u00b2", sender="c/1/a"),
        "seq true": e(secret, r, report(), seq=True, sender="d/1/a"),
        "seq of 5,000 digits": signed(secret, b"report", b'{"sender":"e","seq":'
                                      + b"9" * 5000 + b',"sent":1,"body":{}}'),
        "seq above int64": e(secret, r, report(), seq=2**64, sender="f/1/a"),
        "sent -Infinity": e(secret, r, report(), sent=-math.inf, sender="g/1/a"),
        "sender not a string": e(secret, r, report(), sender=7),
        "sender of 10,000 characters": e(secret, r, report(), sender="s" * 10_000),
        "empty report body": e(secret, r, {}, sender="h/1/a"),
        "body a list": e(secret, r, [1, 2], sender="i/1/a"),
        "node a dict": e(secret, r, report(node={"n2": 1}), sender="j/1/a"),
        "status unknown": e(secret, r, report(status="boom"), sender="k/1/a"),
        "results a string": e(secret, r, report(results="fail"), sender="l/1/a"),
        "result without status": e(secret, r, report(results=[{"name": "x"}]), sender="m/1/a"),
        "reason of 100,000 characters": e(secret, r, report(results=[
            {**FAILING_RESULT, "reason": "r" * 100_000}]), sender="n/1/a"),
        "evidence a list": e(secret, r, report(results=[{**FAILING_RESULT, "evidence": [1]}]),
                             sender="o/1/a"),
        "started 'inf'": e(secret, r, report(started="inf"), sender="p/1/a"),
        "nested 100,000 deep": signed(secret, b"report", b"[" * 100_000),
        "not UTF-8": signed(secret, b"report", b"\xff\xfe"),
        "not an object": signed(secret, b"report", b"[1,2]"),
        "unknown kind": signed(secret, b"bogus", json.dumps({
            "sender": "q/1/a", "seq": 1, "sent": 1, "body": {}}).encode()),
        "metrics loss a stamp": e(secret, m, {"rank": 0, "step": 1, "loss": "\u00b2"},
                                  sender="r/1/a"),
        "metrics step 1.5": e(secret, m, {"rank": 0, "step": 1.5, "loss": 1.0}, sender="t/1/a"),
        "heartbeat rank -1": e(secret, h, {"rank": -1}, sender="u/1/a"),
        "heartbeat rank 10**30": e(secret, h, {"rank": 10**30}, sender="v/1/a"),
    }


class LocalSteps:
    """The ``SlurmBackend`` calls ``NodeInspection`` makes: each step runs here as
    a local process (the real ``python -m ft_launch.health.inspection`` agent)."""

    def launch_step(self, spec: Any, env: Mapping[str, str] | None = None,
                    stdout: int | None = None) -> subprocess.Popen[bytes]:
        return subprocess.Popen(list(spec.command), env=dict(env or {}), stdout=stdout,
                                stderr=subprocess.STDOUT)

    def steps(self, job_id: str) -> list[Any]:
        return []  # cancel_named_step then kills the local process itself


@pytest.fixture
def inspection(tmp_path: Path) -> Iterator[tuple[NodeInspection, str, Path]]:
    secret = new_job_secret()
    config = tmp_path / "health.toml"
    config.write_text(f'[health]\ngpus_per_node = 8\nbackend = "simulated"\n'
                      f'sim_fault_dir = "{tmp_path}"\n'
                      f'[checks.disk]\npaths = ["/"]\nmin_free_bytes = 1\n')
    env = {**os.environ, SECRET_ENV: secret, ENV_CONFIG: str(config)}
    steps: Any = LocalSteps()  # the part of SlurmBackend that NodeInspection uses
    watched = NodeInspection(HealthConfig(inspection_interval=0.2), steps, secret, env, tmp_path)
    try:
        yield watched, secret, tmp_path
    finally:
        watched.close()


def test_signed_malformed_reports_are_counted_and_dropped_and_alarms_still_work(
        inspection: tuple[NodeInspection, str, Path]) -> None:
    watched, secret, fault_dir = inspection
    watched.watch("n2", None)
    hostile = hostile_messages(secret)
    raw = zmq.Context.instance().socket(zmq.PUSH)
    raw.setsockopt(zmq.LINGER, 0)
    raw.connect(watched.collector.endpoint)
    alarms: list[tuple[str, str]] = []
    try:
        for frames in hostile.values():
            raw.send_multipart(frames)

        def all_dropped() -> bool:
            alarms.extend(watched.alarms())  # raised here before: OverflowError, KeyError
            return watched.rejected_messages["invalid"] >= len(hostile)

        wait_until(all_dropped, 30, "every hostile message counted")
        assert watched.rejected_messages["invalid"] == len(hostile)
        assert alarms == []  # each claimed n2 failed; none was believed
        (fault_dir / "n2.json").write_text(json.dumps([{"gpu": 5, "xid": 94}]))

        def alarmed() -> bool:
            alarms.extend(watched.alarms())
            return bool(alarms)

        wait_until(alarmed, 60, "the real agent's alarm after the hostile messages")
        assert alarms == [("n2", "inspection: gpu5 xid 94")]
    finally:
        raw.close(0)


# ------------------------------------------------------------------ the decoder, fuzzed

_SECRET = new_job_secret()
_json = st.recursive(
    st.none() | st.booleans() | st.integers(-2**70, 2**70) | st.floats() | st.text(max_size=12),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner,
                                                                max_size=4),
    max_leaves=12)
#: Valid messages of each kind, as senders write them (optional fields left out
#: in some): mutating one or two of their fields reaches every check.
_VALID = [
    ("report", HEALTHY_REPORT),
    ("report", report()),
    ("report", {"profile": "p", "node": "n", "status": "warn",
                "results": [{"name": "c", "status": "warn", "reason": ""}]}),
    ("metrics", {"rank": 0, "step": 3, "loss": "nan", "grad_norm": 1.0, "step_time": 0.5,
                 "tokens": 4096}),
    ("metrics", {"rank": 2, "step": 0, "loss": 1.5}),
    ("heartbeat", {"rank": 1}),
]


def _paths(value: Any, prefix: tuple[Any, ...] = ()) -> list[tuple[Any, ...]]:
    """Every key path into nested dicts and lists."""
    found = [prefix] if prefix else []
    items = value.items() if isinstance(value, dict) else (
        enumerate(value) if isinstance(value, list) else ())
    for key, inner in items:
        found += _paths(inner, (*prefix, key))
    return found


def _mutated(value: Any, path: tuple[Any, ...], new: Any, delete: bool) -> Any:
    if not path:
        return new
    copy = dict(value) if isinstance(value, dict) else list(value)
    head, rest = path[0], path[1:]
    if delete and not rest and isinstance(copy, dict):
        del copy[head]
    else:
        copy[head] = _mutated(copy[head], rest, new, delete)
    return copy


@st.composite
def _messages(draw: st.DrawFn) -> list[bytes]:
    kind, body = draw(st.sampled_from(_VALID))
    message: Any = {"sender": "agent:n2/1/a", "seq": 5, "sent": 1.0, "body": body}
    for _ in range(draw(st.integers(0, 2))):
        paths = _paths(message)
        if not paths:
            break
        path = draw(st.sampled_from(paths))
        message = _mutated(message, path, draw(_json), delete=draw(st.booleans()))
    return signed(_SECRET, kind.encode(), json.dumps(message).encode())


def _consume(envelope: Envelope) -> None:
    """What the controller does with an accepted envelope: none of it may raise."""
    found = report_from(envelope)
    if found is not None:
        node_alarm(found)
    DetectionMonitor().observe(envelope, 0.0)


@settings(max_examples=1000, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(_messages())
def test_any_signed_json_is_accepted_whole_or_rejected_as_a_wire_error(
        frames: list[bytes]) -> None:
    try:
        envelope = decode(_SECRET, frames)
    except WireError:
        return
    _consume(envelope)


# ------------------------------------------------------------------ floods and sizes

def _poll_until(collector: Collector, condition: Any, timeout: float, what: str) -> list[Envelope]:
    received: list[Envelope] = []

    def check() -> bool:
        received.extend(collector.poll(0.05))
        return bool(condition(received))

    wait_until(check, timeout, what)
    return received


def test_a_flood_of_junk_costs_a_few_log_lines_and_is_counted_exactly(
        caplog: pytest.LogCaptureFixture) -> None:
    secret = new_job_secret()
    collector = Collector(secret)
    bad_signature, unsigned = 2500, 1200
    raw = zmq.Context.instance().socket(zmq.PUSH)
    raw.setsockopt(zmq.LINGER, 0)
    raw.connect(collector.endpoint)

    def flood() -> None:  # from a thread: the queues fill long before 3,700 messages
        for i in range(bad_signature):
            raw.send_multipart([PROTOCOL, b"report", b"junk %d" % i, b"\x00" * 32])
        for _ in range(unsigned):
            raw.send_multipart([b"junk"])

    caplog.set_level(logging.WARNING, logger="ft_launch.health.channel")
    sender = threading.Thread(target=flood, daemon=True)
    sender.start()
    try:
        _poll_until(collector, lambda _: collector.rejected >= bad_signature + unsigned, 60,
                    "every junk message counted")
        sender.join(10)
        assert collector.rejections == {"bad_signature": bad_signature, "malformed": unsigned,
                                        "invalid": 0, "replayed": 0}
        lines = [r for r in caplog.records if r.name == "ft_launch.health.channel"]
        # The first of each kind, then one per SAMPLE_EVERY: 3 + 2 lines, not 3,700.
        assert len(lines) == sum(1 + n // SAMPLE_EVERY for n in (bad_signature, unsigned))
        assert "bad_signature" in lines[0].getMessage() and "so far" in lines[0].getMessage()
    finally:
        raw.close(0)
        collector.close()


def test_an_oversize_frame_ends_the_connection_unbuffered_and_others_still_flow() -> None:
    secret = new_job_secret()
    collector = Collector(secret)
    frame = 96 << 20
    me = psutil.Process()
    before = me.memory_info().rss
    attacker = RawPeer(collector.endpoint, b"PUSH")
    sender = Sender(collector.endpoint, secret, "rank:0/1/a")
    try:
        completed = attacker.stream_frame(frame)
        grown = me.memory_info().rss - before
        assert not completed, f"the collector read all of a {frame >> 20} MiB frame"
        assert grown < frame // 2, f"memory grew by {grown >> 20} MiB"
        assert frame > 2 * MAX_FRAME_BYTES
        sender.send(MessageKind.HEARTBEAT, {"rank": 0})
        got = _poll_until(collector, lambda r: r, 20, "a heartbeat after the oversize frame")
        assert [(e.sender, e.body) for e in got] == [("rank:0/1/a", {"rank": 0})]
    finally:
        attacker.close()
        sender.close()
        collector.close()


def test_a_sender_drops_a_message_above_the_limit_rather_than_raising() -> None:
    secret = new_job_secret()
    collector = Collector(secret)
    sender = Sender(collector.endpoint, secret, "agent:n1/1/a")
    try:
        huge = {**HEALTHY_REPORT, "results": [{**FAILING_RESULT,
                                               "evidence": {"x": "e" * MAX_FRAME_BYTES}}]}
        assert sender.send(MessageKind.REPORT, huge) is False and sender.dropped == 1
        assert sender.send(MessageKind.REPORT, HEALTHY_REPORT) is True
        got = _poll_until(collector, lambda r: r, 20, "the report that fits")
        assert [e.seq for e in got] == [2] and collector.rejected == 0
    finally:
        sender.close()
        collector.close()


def test_one_poll_takes_a_bounded_number_of_messages(monkeypatch: pytest.MonkeyPatch) -> None:
    """A flood cannot keep the controller's loop inside one ``poll``."""
    monkeypatch.setattr("ft_launch.health.channel.MAX_PER_POLL", 10)
    collector = Collector(new_job_secret())
    raw = zmq.Context.instance().socket(zmq.PUSH)
    raw.setsockopt(zmq.LINGER, 0)
    raw.connect(collector.endpoint)
    per_call: list[int] = []

    def counted() -> bool:
        before = collector.rejected
        collector.poll(0.05)
        per_call.append(collector.rejected - before)
        return collector.rejected >= 100

    try:
        for _ in range(100):
            raw.send_multipart([b"junk"])
        wait_until(counted, 30, "every junk message counted")
        assert max(per_call) <= 10 and collector.rejected == 100
        assert len([n for n in per_call if n]) >= 10
    finally:
        raw.close(0)
        collector.close()
