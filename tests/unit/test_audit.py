"""The exactly-once audit (``ft_launch.launcher.worker.audit``) over real audit files, with and
without rollbacks and rewinds: the history after a rollback supersedes the steps it
trained again, the branch a rewind went on from supersedes the one it left, and the
check is exact about the rollback and the rewind themselves."""

from __future__ import annotations

from pathlib import Path

import pytest

from ft_launch.launcher.worker.audit import AuditError, AuditLog, audit_records, check_exactly_once

BATCH = 8


def logs(run_dir: Path, replicas: int = 3) -> list[AuditLog]:
    return [AuditLog(run_dir / "audit" / f"replica-{r}.jsonl") for r in range(replicas)]


def train(audits: list[AuditLog], steps: range, history: int = 0,
          counts: tuple[int, ...] | None = None, writers: tuple[int, ...] | None = None
          ) -> None:
    """Steps from ``steps.start`` on (positions as if every replica trained each step
    before), each replica's rank 0 writing its line."""
    counts = counts or (BATCH,) * len(audits)
    for step in steps:
        before = [BATCH * step] * len(audits)
        for replica in writers or range(len(audits)):
            audits[replica].step(step, 1, before, list(counts), history)


def test_a_run_without_rollback_is_checked_as_before(tmp_path):
    audits = logs(tmp_path)
    train(audits, range(10))
    summary = check_exactly_once(tmp_path, 3, 10)
    assert summary.positions == (80, 80, 80) and (summary.rollbacks, summary.rolled_back) == (0, 0)
    audits[1].step(10, 1, [80, 80, 80], [8, 0, 8], 0)      # a disputed step
    audits[2].step(10, 1, [80, 80, 80], [8, 8, 8], 0)
    with pytest.raises(AuditError, match="disagree on step 10"):
        check_exactly_once(tmp_path, 3)


def rolled_back(run_dir: Path, restored: int = 7, spike: int = 10, upto: int = 13):
    """Trained to ``upto - 1`` (the spike at ``spike``), then every replica rolled back
    to ``restored``."""
    audits = logs(run_dir)
    train(audits, range(upto))
    for audit in audits:
        audit.rollback(1, spike, restored)
        audit.rollback(1, spike, restored + 3)     # a later relaunch: once per history
    return audits


def test_the_history_after_a_rollback_supersedes_the_steps_it_trained_again(tmp_path):
    audits = rolled_back(tmp_path)
    # trained again from step 8, this time with replica 2 catching up at first (no samples)
    train(audits, range(8, 9), history=1, counts=(BATCH, BATCH, 0))
    for step in range(9, 20):
        before = [BATCH * step, BATCH * step, BATCH * (step - 1)]
        for audit in audits:
            audit.step(step, 2, before, [BATCH] * 3, 1)
    summary = check_exactly_once(tmp_path, 3, 20)
    assert (summary.rollbacks, summary.rolled_back) == (1, 3 * 5)   # steps 8..12 of 3
    assert summary.positions == (160, 160, 152)
    assert sorted(audit_records(tmp_path)) == list(range(20))
    text = (tmp_path / "audit" / "replica-0.jsonl").read_text()
    assert text.count('"rollback": 1') == 1


def test_a_history_that_no_rollback_line_records_fails(tmp_path):
    audits = logs(tmp_path)
    train(audits, range(13))
    train(audits, range(8, 20), history=1)
    with pytest.raises(AuditError, match="history 1, which no rollback line records"):
        check_exactly_once(tmp_path, 3, 20)


def test_a_rollback_to_a_state_after_the_spike_fails(tmp_path):
    audits = rolled_back(tmp_path, restored=10)
    train(audits, range(11, 20), history=1)
    with pytest.raises(AuditError, match="to before step 10: replica-0.jsonl restarted from "
                                         "step 10"):
        check_exactly_once(tmp_path, 3, 20)


def test_a_history_going_on_from_a_newer_state_than_any_restored_fails(tmp_path):
    """It took the spike back: caught up from a process of the old history."""
    audits = rolled_back(tmp_path, restored=7)
    train(audits, range(13, 20), history=1)
    with pytest.raises(AuditError, match="history 1 starts at step 13, after every restored "
                                         "state"):
        check_exactly_once(tmp_path, 3, 20)


def test_a_rollback_of_a_step_never_committed_or_disputed_fails(tmp_path):
    audits = rolled_back(tmp_path, spike=30)
    train(audits, range(8, 20), history=1)
    with pytest.raises(AuditError, match="spiking step 30 was never committed"):
        check_exactly_once(tmp_path, 3, 20)
    other = tmp_path / "other"
    audits = rolled_back(other)
    audits[0].rollback(1, 11, 7)                 # recorded already: kept as it was
    AuditLog(other / "audit" / "replica-9.jsonl").rollback(1, 11, 7)
    train(audits, range(8, 20), history=1)
    with pytest.raises(AuditError, match=r"different spiking steps \[10, 11\]"):
        check_exactly_once(other, 3, 20)


def rewound(run_dir: Path, restored: int = 7, upto: int = 13) -> list[AuditLog]:
    """Replicas 0 and 1 trained to ``upto - 1`` in quorum 1 and were lost; replica 1
    restarted first from step ``restored`` and trained on alone in quorum 2, replica 0
    catching up from it in quorum 3 (it restored the same state first)."""
    audits = logs(run_dir, replicas=2)
    for step in range(upto):
        for audit in audits:
            audit.step(step, 1, [BATCH * step] * 2, [BATCH] * 2, 0)
    for audit in audits:
        audit.restored(restored, 0)
    before = [BATCH * (restored + 1)] * 2
    for step in range(restored + 1, restored + 4):     # replica 1 alone: replica 0 stays
        audits[1].step(step, 2, list(before), [0, BATCH], 0)
        before[1] += BATCH
    for step in range(restored + 4, 20):
        for audit in audits:
            audit.step(step, 3, list(before), [BATCH] * 2, 0)
        before = [b + BATCH for b in before]
    return audits


def test_the_branch_the_run_went_on_from_after_a_restore_supersedes_the_other(tmp_path):
    rewound(tmp_path)
    summary = check_exactly_once(tmp_path, 2, 20)
    assert (summary.rollbacks, summary.rolled_back) == (0, 2 * 5)       # steps 8..12 of 2
    assert summary.positions == (20 * BATCH - 3 * BATCH, 20 * BATCH)
    assert sorted(audit_records(tmp_path)) == list(range(20))


def test_steps_trained_again_after_no_restore_fail(tmp_path):
    """Without a restore of step 7 nothing explains the second branch from step 8: the
    replicas disagree."""
    rewound(tmp_path)
    for replica in range(2):
        path = tmp_path / "audit" / f"replica-{replica}.jsonl"
        path.write_text("".join(line for line in path.read_text().splitlines(keepends=True)
                                if '"restored"' not in line))
    with pytest.raises(AuditError, match="disagree on step 8: .*, and no replica restored "
                                         "step 7"):
        check_exactly_once(tmp_path, 2, 20)


def test_a_line_of_the_lost_branch_after_the_rewind_is_caught(tmp_path):
    """Replica 0's process from before the rewind went on past it (a stale process that
    Slurm had not ended): the step it alone committed does not join up."""
    audits = rewound(tmp_path)
    audits[0].step(20, 1, [BATCH * 20] * 2, [BATCH] * 2, 0)
    with pytest.raises(AuditError, match="step 20 starts at positions"):
        check_exactly_once(tmp_path, 2, 21)


def test_two_branches_after_the_last_step_left_are_a_dispute(tmp_path):
    audits = rewound(tmp_path)
    audits[0].step(19, 3, [BATCH * 19] * 2, [0, BATCH], 0)
    with pytest.raises(AuditError, match="disagree on step 19"):
        check_exactly_once(tmp_path, 2, 20)
