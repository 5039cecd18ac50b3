"""The files of a dual-phase replay (``ft_launch.launcher.worker.replay_files``): what is written
reads back the same, and every file that is not what it should be is refused with
its path, the field and what was expected."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest

from ft_launch.ckpt.manifest import Manifest, TensorDesc, add_checksums, plan_layout
from ft_launch.launcher.worker.replay_files import (
    MAX_RECORD_BYTES,
    RankDigest,
    ReplayFileError,
    ReplaySpec,
    load_captured,
    publish_state_servers,
    read_result,
    read_spec,
    read_state_servers,
    save_captured,
    servers_file,
    state_files,
    write_result,
    write_spec,
)

DIGEST = "ab" * 32


@pytest.fixture
def spec(tmp_path: Path) -> ReplaySpec:
    return ReplaySpec("replica-1-1", 1, 41, 2, str(tmp_path / "state"),
                      str(tmp_path / "results"))


def test_a_spec_and_a_result_read_back_as_written(spec: ReplaySpec, tmp_path: Path) -> None:
    path = write_spec(tmp_path / "spec.json", spec)
    assert read_spec(path) == spec
    result = RankDigest("row1", 1, "n5", 42, DIGEST, 7, 3)
    assert read_result(write_result(spec, result)) == result
    assert spec.result_file("row1", 1) == tmp_path / "results" / "row1" / "rank-1.json"


@pytest.mark.parametrize("change, message", [
    ({"step": "41"}, "field 'step' must be int, got '41'"),
    ({"ranks": True}, "field 'ranks' must be int, got True"),
    ({"replay_id": "../x"}, "field 'replay_id' must be 1-64 letters"),
    ({"ranks": 0}, "ranks >= 1"),
])
def test_a_bad_spec_names_its_file_and_field(spec: ReplaySpec, tmp_path: Path,
                                             change: dict, message: str) -> None:
    path = tmp_path / "spec.json"
    path.write_text(json.dumps({**json.loads(write_spec(path, spec).read_text()), **change}))
    with pytest.raises(ReplayFileError, match=message) as error:
        read_spec(path)
    assert str(path) in str(error.value)


def test_what_is_not_a_record_is_refused_unread(tmp_path: Path) -> None:
    big = tmp_path / "big.json"
    big.write_bytes(b" " * (MAX_RECORD_BYTES + 1))
    with pytest.raises(ReplayFileError, match="longer than"):
        read_spec(big)
    listed = tmp_path / "list.json"
    listed.write_text("[1, 2]")
    with pytest.raises(ReplayFileError, match="expected a JSON object"):
        read_result(listed)
    with pytest.raises(ReplayFileError, match="cannot read it"):
        read_spec(tmp_path / "missing.json")


def test_a_result_with_a_bad_digest_is_refused(spec: ReplaySpec) -> None:
    path = write_result(spec, RankDigest("row0", 0, "n4", 42, DIGEST, 0, 3))
    path.write_text(path.read_text().replace(DIGEST, "xyz"))
    with pytest.raises(ReplayFileError, match="64 hex digits"):
        read_result(path)


def test_state_servers_are_read_only_for_their_replica_and_job(tmp_path: Path) -> None:
    publish_state_servers(tmp_path, 0, "77", [("10.0.0.2", 4001), ("10.0.0.3", 4002)])
    assert read_state_servers(tmp_path, 0, "77") == (("10.0.0.2", 4001), ("10.0.0.3", 4002))
    with pytest.raises(ReplayFileError, match="not replica 0 of job '78'"):
        read_state_servers(tmp_path, 0, "78")
    servers_file(tmp_path, 1).write_text(json.dumps(
        {"replica_id": 1, "job_id": "77", "state": [["h"]]}))
    with pytest.raises(ReplayFileError, match=r"must list \[host, port\] pairs"):
        read_state_servers(tmp_path, 1, "77")


def captured_state() -> tuple[Manifest, np.ndarray]:
    specs, total = plan_layout([TensorDesc("w", "float32", (4,)), TensorDesc("b", "int64", (2,))])
    buffer = np.arange(total, dtype=np.uint8)
    manifest = Manifest(41, specs, total, rank=1, world_size=2,
                        meta={"loader": {"positions": [8, 16]}})
    return add_checksums(manifest, buffer), buffer


def test_a_captured_state_reads_back_checked(tmp_path: Path) -> None:
    manifest, buffer = captured_state()
    save_captured(tmp_path, 1, manifest, buffer)
    loaded, data = load_captured(tmp_path, 1)
    assert loaded == manifest and bytes(data) == bytes(buffer)
    manifest_path, data_path = state_files(tmp_path, 1)
    flipped = bytearray(data_path.read_bytes())
    flipped[0] ^= 1
    data_path.write_bytes(bytes(flipped))
    with pytest.raises(ReplayFileError, match="fails its checksums") as error:
        load_captured(tmp_path, 1)
    assert str(data_path) in str(error.value)
    data_path.write_bytes(bytes(flipped[:-1]))
    with pytest.raises(ReplayFileError, match="its manifest says"):
        load_captured(tmp_path, 1)
    manifest_path.write_text(replace(manifest, total_bytes=-1).to_json())
    with pytest.raises(ReplayFileError, match=str(manifest_path)):
        load_captured(tmp_path, 1)
