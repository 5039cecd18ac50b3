"""The drain request a controller without operator rights leaves for the Epilog."""

import os

import pytest

from ft_launch.health.drain_request import (
    InvalidDrainRequest,
    job_comment,
    requested_reason,
    write_request,
)

UID = os.getuid()


def test_the_epilog_honours_a_request_only_for_its_own_node_and_job(tmp_path):
    write_request(tmp_path, "42", "n3", "replica 1 made\nno progress")
    record = {"JobId": "42", "Comment": job_comment(tmp_path)}
    assert requested_reason(record, "42", "n3", UID) == \
        "evicted by ft-launch (job 42): replica 1 made no progress"
    assert requested_reason(record, "42", "n4", UID) is None        # no request for n4
    assert requested_reason(record, "43", "n3", UID) is None        # another job's request
    assert requested_reason({"JobId": "42", "Comment": "x"}, "42", "n3", UID) is None
    (tmp_path / "drain-requests" / "n3.json").write_text("{broken")
    with pytest.raises(InvalidDrainRequest, match="not JSON"):       # fails closed
        requested_reason(record, "42", "n3", UID)


def _request(tmp_path, text):
    (tmp_path / "drain-requests").mkdir(exist_ok=True)
    (tmp_path / "drain-requests" / "n3.json").write_text(text)
    return {"JobId": "42", "Comment": job_comment(tmp_path)}


def test_a_missing_run_dir_or_request_is_no_request(tmp_path):
    record = {"JobId": "42", "Comment": job_comment(tmp_path / "gone")}
    assert requested_reason(record, "42", "n3", UID) is None
    (tmp_path / "gone").mkdir()
    assert requested_reason(record, "42", "n3", UID) is None        # no drain-requests/


@pytest.mark.parametrize("node, uid, text, why", [
    ("n3", None, "{}", "job uid unknown"),                    # owner cannot be checked
    ("../n3", UID, "{}", "not a Slurm node name"),           # a name that leaves the folder
    ("n3", UID, "[" * 4000, "not JSON"),                      # too deep for the decoder
    ("n3", UID, "[1]", "not a JSON object"),
    ("n3", UID, "\xff", "not JSON"),
])
def test_the_reader_refuses_what_it_cannot_trust(tmp_path, node, uid, text, why):
    record = _request(tmp_path, text)
    with pytest.raises(InvalidDrainRequest, match=why):
        requested_reason(record, "42", node, uid)


def test_a_run_dir_that_is_not_a_directory_is_refused(tmp_path):
    (tmp_path / "file").write_text("")
    record = {"JobId": "42", "Comment": job_comment(tmp_path / "file")}
    with pytest.raises(InvalidDrainRequest, match="Not a directory"):
        requested_reason(record, "42", "n3", UID)
