"""Peer directories: publishing, lookup, signatures, replacement."""

from __future__ import annotations

import json
from pathlib import Path

from ft_launch.ids import new_job_secret
from ft_launch.launcher.quorum.directory import FileDirectory, PeerRecord, StaticDirectory

SECRET = new_job_secret()


def test_file_directory_round_trip(tmp_path: Path) -> None:
    directory = FileDirectory(tmp_path, SECRET, "job-1")
    record = PeerRecord(3, "tcp://10.0.0.3:4100", incarnation=17)
    directory.publish(record)
    assert directory.lookup(3) == record
    assert directory.lookup(4) is None
    assert json.loads(directory.file_for(3).read_text())["address"] == record.address


def test_replacement_overwrites_the_record(tmp_path: Path) -> None:
    directory = FileDirectory(tmp_path, SECRET, "job-1")
    directory.publish(PeerRecord(3, "tcp://10.0.0.3:4100", 17))
    directory.publish(PeerRecord(3, "tcp://10.0.0.9:4200", 18))
    assert directory.lookup(3) == PeerRecord(3, "tcp://10.0.0.9:4200", 18)


def test_records_not_signed_for_this_job_are_ignored(tmp_path: Path) -> None:
    FileDirectory(tmp_path, new_job_secret(), "job-1").publish(PeerRecord(1, "tcp://evil:1", 9))
    FileDirectory(tmp_path, SECRET, "job-2").publish(PeerRecord(2, "tcp://other:1", 9))
    directory = FileDirectory(tmp_path, SECRET, "job-1")
    directory.publish(PeerRecord(3, "tcp://ok:1", 9))
    body = json.loads(directory.file_for(3).read_text())
    body["address"] = "tcp://evil:2"
    directory.file_for(3).write_text(json.dumps(body))
    directory.file_for(4).write_text("{not json")
    assert [directory.lookup(r) for r in (1, 2, 3, 4)] == [None, None, None, None]


def test_newer_than() -> None:
    old = PeerRecord(1, "tcp://a:1", 5)
    assert PeerRecord(1, "tcp://b:1", 6).newer_than(old)
    assert PeerRecord(1, "tcp://b:1", 5).newer_than(old)  # same incarnation, moved
    assert not PeerRecord(1, "tcp://b:1", 4).newer_than(old)  # a zombie's record
    assert not PeerRecord(1, "tcp://a:1", 5).newer_than(old)
    assert old.newer_than(None)


def test_static_directory() -> None:
    directory = StaticDirectory({0: "tcp://a:1"})
    assert directory.lookup(0) == PeerRecord(0, "tcp://a:1")
    directory.publish(PeerRecord(1, "tcp://b:1", 3))
    assert directory.lookup(1) == PeerRecord(1, "tcp://b:1", 3)
    assert directory.lookup(2) is None
