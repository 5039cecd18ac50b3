"""The inspection agent as a real process streaming signed reports over loopback
ZeroMQ; a fault injected while it runs reaches the controller as an alarm; forged
and replayed messages are dropped."""

import json
import os
import signal
import subprocess
import sys
import time

import pytest
import zmq

from ft_launch.health.channel import Collector, Sender
from ft_launch.health.inspection import InspectionAgent, node_alarm, report_from
from ft_launch.health.settings import parse_settings
from ft_launch.health.wire import Envelope, MessageKind, ReplayGuard, WireError, decode, encode
from ft_launch.ids import new_job_secret
from tests.waiting import patience

pytestmark = pytest.mark.timeout(60)


def collect_until(collector, condition, timeout):
    timeout = patience(timeout)  # a wait, not a claim: stretched by the machine's load
    deadline = time.monotonic() + timeout
    seen = []
    while time.monotonic() < deadline:
        seen += collector.poll(0.2)
        if any(condition(e) for e in seen):
            return seen
    raise AssertionError(f"timed out after {timeout:.1f}s; got {len(seen)} messages")


def test_agent_process_reports_until_a_fault_then_alarms(tmp_path):
    secret = new_job_secret()
    config = tmp_path / "health.toml"
    config.write_text(f'[health]\ngpus_per_node = 8\nbackend = "simulated"\n'
                      f'sim_fault_dir = "{tmp_path}"\n'
                      f'[checks.disk]\npaths = ["/"]\nmin_free_bytes = 1\n')
    collector = Collector(secret)
    agent = subprocess.Popen(
        [sys.executable, "-m", "ft_launch.health.inspection", "--endpoint", collector.endpoint,
         "--node", "n2", "--interval", "0.2", "--config", str(config)],
        env={**os.environ, "FTL_WORKER_SECRET": secret},
        stderr=subprocess.DEVNULL)
    try:
        first = collect_until(collector, lambda e: e.kind is MessageKind.REPORT, 20)
        healthy = report_from(first[0])
        assert healthy.node == "n2" and node_alarm(healthy) is None
        (tmp_path / "n2.json").write_text(json.dumps([{"gpu": 5, "xid": 94}]))
        seen = collect_until(collector, lambda e: node_alarm(report_from(e)) is not None, 20)
        alarm = next(a for a in map(node_alarm, map(report_from, seen)) if a)
        assert (alarm.node, alarm.check, alarm.reason) == ("n2", "gpu_xid", "gpu5 xid 94")
    finally:
        agent.send_signal(signal.SIGTERM)
        assert agent.wait(timeout=patience(20)) == 0
        collector.close()


def test_agent_in_process_run_once(tmp_path):
    secret = new_job_secret()
    collector = Collector(secret)
    settings = parse_settings({"health": {"backend": "simulated", "gpus_per_node": 2},
                               "checks": {"disk": {"min_free_bytes": 1}}}, "t")
    agent = InspectionAgent(settings, "n1", collector.endpoint, secret, interval=60)
    try:
        report = agent.run_once()
        assert report.failure is None
        got = collect_until(collector, lambda e: True, 10)
        assert report_from(got[0]).results == report.results
    finally:
        agent.stop()
        collector.close()


def test_collector_drops_forged_and_replayed_messages():
    secret = new_job_secret()
    collector = Collector(secret)
    intruder = Sender(collector.endpoint, new_job_secret(), "intruder/1/x")
    raw = zmq.Context.instance().socket(zmq.PUSH)
    raw.setsockopt(zmq.LINGER, 0)
    raw.connect(collector.endpoint)
    try:
        intruder.send(MessageKind.HEARTBEAT, {"rank": 0})
        frames = encode(secret, Envelope(MessageKind.HEARTBEAT, "rank:0/1/y", 7, 0.0, {"rank": 0}))
        raw.send_multipart(frames)
        raw.send_multipart(frames)               # replayed
        raw.send_multipart([b"junk"])
        deadline = time.monotonic() + patience(10)
        accepted = []
        while collector.rejected < 3 and time.monotonic() < deadline:
            accepted += collector.poll(0.2)
        assert collector.rejected == 3
        assert [e.seq for e in accepted] == [7]
    finally:
        intruder.close()
        raw.close(0)
        collector.close()


def test_wire_round_trip_and_guard():
    secret = new_job_secret()
    envelope = Envelope(MessageKind.METRICS, "rank:1/2/z", 3, 1.5,
                        {"rank": 1, "step": 3, "loss": "nan"})
    assert decode(secret, encode(secret, envelope)) == envelope
    tampered = encode(secret, envelope)
    tampered[2] = tampered[2].replace(b"nan", b"1.0")
    with pytest.raises(WireError, match="bad signature"):
        decode(secret, tampered)
    guard = ReplayGuard()
    assert guard.accept(envelope) and not guard.accept(envelope)
