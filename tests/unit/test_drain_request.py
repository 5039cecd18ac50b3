"""The drain request a controller without operator rights leaves for the Epilog."""

from launcher.drain_request import job_comment, requested_reason, write_request


def test_the_epilog_honours_a_request_only_for_its_own_node_and_job(tmp_path):
    write_request(tmp_path, "42", "n3", "replica 1 made\nno progress")
    record = {"JobId": "42", "Comment": job_comment(tmp_path)}
    assert requested_reason(record, "42", "n3") == \
        "evicted by ft-launch (job 42): replica 1 made no progress"
    assert requested_reason(record, "42", "n4") is None        # no request for n4
    assert requested_reason(record, "43", "n3") is None        # another job's request
    assert requested_reason({"JobId": "42", "Comment": "x"}, "42", "n3") is None
    (tmp_path / "drain-requests" / "n3.json").write_text("{broken")
    assert requested_reason(record, "42", "n3") is None
