import os

import pytest

from ft_launch.events import EventLog, NodeDrained, StepEnded, read_events
from ft_launch.files import atomic_write_text
from ft_launch.ids import new_job_secret, sign, verify


def test_events_round_trip_and_torn_tail(tmp_path):
    path = tmp_path / "events.jsonl"
    with EventLog(path) as log:
        log.emit(NodeDrained(node="n3", reason="ft-launch: gpu lost"))
        log.emit(StepEnded(job_id="7", replica_id=1, step_id="3", exit_code=137))
    with path.open("a") as handle:
        handle.write('{"event": "NodeDrained", "node": "n4"')  # writer died mid-line
    events = list(read_events(path))
    assert [type(e).__name__ for e in events] == ["NodeDrained", "StepEnded"]
    assert events[1].exit_code == 137 and events[0].reason == "ft-launch: gpu lost"


def test_atomic_write_keeps_old_content_when_write_fails(tmp_path, monkeypatch):
    target = tmp_path / "state.json"
    atomic_write_text(target, "old")

    def disk_full(src, dst):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr("ft_launch.files.os.replace", disk_full)
    with pytest.raises(OSError, match="No space"):
        atomic_write_text(target, "new")
    assert target.read_text() == "old"
    assert os.listdir(tmp_path) == ["state.json"]  # no temp file left behind


def test_signature_binds_secret_and_parts():
    secret = new_job_secret()
    signature = sign(secret, b"quorum", b"7")
    assert verify(secret, signature, b"quorum", b"7")
    assert not verify(secret, signature, b"quorum", b"8")
    assert not verify(new_job_secret(), signature, b"quorum", b"7")
    # length prefixes: the same bytes split differently must not verify
    assert not verify(secret, signature, b"quorum7")
