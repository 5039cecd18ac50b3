"""The example's end-step file: a run shortened while it trains ends on every replica
at the same step, with nothing lost (the lab's Slurm tests end their runs this way
once the recovery they test is over: ``tests/slurm/test_run.py`` ``end_early``)."""

from __future__ import annotations

import pytest

from ft_launch.files import atomic_write_text
from tests.scale.helpers import load_script
from tests.waiting import patience, wait_until

from .harness import TRAIN, check_run, loopback_job

pytest.importorskip("torch")


@pytest.fixture(scope="module")
def train():
    return load_script(TRAIN)


@pytest.mark.parametrize("content, expected", [(None, 200), ("120", 120), ("500", 200),
                                               ("soon", 200), ("", 200)])
def test_the_end_step_file_shortens_a_run_and_nothing_else(train, tmp_path, content, expected):
    if content is not None:
        (tmp_path / train.END_STEP_FILE).write_text(content)
    assert train.end_step_at(tmp_path, 200) == expected


def test_a_run_ended_early_ends_every_replica_at_that_step_identical_and_exactly_once(
        train, tmp_path):
    steps = 2000      # an upper bound: the run is ended far sooner
    job = loopback_job(tmp_path, replicas=2, steps=steps)
    job.start_all()
    try:
        wait_until(lambda: min(job.last_committed_step(r) for r in range(2)) >= 10, 120,
                   "both replicas to train 10 steps")
        end = max(job.last_committed_step(r) for r in range(2)) + 100   # ahead of both
        atomic_write_text(tmp_path / train.END_STEP_FILE, str(end), durable=False)
        codes = job.wait_all(patience(180))
    finally:
        job.stop_everything()
    assert codes == {0: 0, 1: 0}, {r: job.log(r)[-2000:] for r in codes}
    finals = job.finals()
    assert {f["step"] for f in finals.values()} == {end - 1}
    assert len({f["state_sha256"] for f in finals.values()}) == 1
    assert all(f["positions"] == check_run(job, end) for f in finals.values())
