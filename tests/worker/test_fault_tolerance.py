"""The step protocol end to end: real replica processes on loopback, real sockets,
scripted faults. Invariants: surviving replicas keep stepping, a restarted replica
catches up over HTTP, every replica ends bit-identical, every sample trained once."""

from __future__ import annotations

import json
import math
import signal
import socket

import pytest

from ft_launch.launcher.quorum.witness_service import MemoryFile, replica_memory_path
from ft_launch.launcher.worker.audit import check_exactly_once
from ft_launch.launcher.worker.local import LocalJob
from tests.waiting import patience, wait_until

from .harness import check_run, loopback_job, max_gap, stall_bound

pytestmark = [pytest.mark.timeout(240)]

LONG_RUN = 400


def detection(job: LocalJob) -> float:
    """How long a healthy replica takes to go on without a lost one, by the job's
    config: the quorum notices (member timeout) and forms anew (join window)."""
    return (float(job.config_env["FTL_QUORUM_MEMBER_TIMEOUT"])
            + float(job.config_env["FTL_QUORUM_JOIN_TIMEOUT"]))


def assert_kept_stepping(job: LocalJob, replica: int) -> None:
    events = job.events(replica)
    gap, bound = max_gap(events), stall_bound(detection(job), events)
    assert gap < bound, f"replica {replica} stalled {gap:.1f} s (bound {bound:.1f} s)"


def finish_and_check(job: LocalJob, steps: int, timeout: float = 180) -> dict[int, dict]:
    codes = job.wait_all(patience(timeout))
    assert all(code == 0 for code in codes.values()), {r: job.log(r)[-3000:] for r in codes}
    finals = job.finals()
    hashes = {f["state_sha256"] for f in finals.values()}
    assert len(hashes) == 1, f"replicas diverged: {finals}"
    positions = check_run(job, steps)
    assert all(f["positions"] == positions for f in finals.values())
    return finals


def assert_ranks_agree(run_dir, replicas: int, ranks: int) -> None:
    """Rank k of every replica ends with the same state (its shards under FSDP2)."""
    for rank in range(ranks):
        finals = [json.loads(p.read_text())
                  for p in (run_dir / "final").glob(f"*-rank-{rank}.json")]
        assert len(finals) == replicas and len({f["state_sha256"] for f in finals}) == 1, finals


def test_no_faults_replicas_bit_identical_and_loss_falls(tmp_path):
    job = loopback_job(tmp_path, replicas=3, steps=40)
    job.start_all()
    try:
        finish_and_check(job, 40)
    finally:
        job.stop_everything()
    first = [e for e in job.committed(0) if e.step == 0]
    assert first and all(e.contributors == 3 and e.lr_factor == 1.0 for e in job.committed(0))
    losses = [float(line.split(" loss ")[1].split()[0]) for line in job.log(0).splitlines()
              if " loss " in line]
    assert losses[-1] < losses[0] - 0.3, losses


@pytest.mark.parametrize("parallel", ["ddp", "none"])
def test_replicated_replicas_of_two_ranks_train_as_one_model(tmp_path, parallel):
    """DDP replicas (FTAR in DDP's comm hook) and replicas averaged by hand (after
    backward): every rank of every replica ends with the same whole model, and a
    step's gradients count the samples of all six ranks."""
    job = loopback_job(tmp_path, replicas=3, steps=30, ranks=2, parallel=parallel)
    job.start_all()
    try:
        finish_and_check(job, 30)
    finally:
        job.stop_everything()
    finals = [json.loads(p.read_text()) for p in (tmp_path / "final").glob("*.json")]
    assert len(finals) == 6 and len({f["state_sha256"] for f in finals}) == 1


def kill_and_restart(job: LocalJob, replica: int, inject: str, restart_after_step: int = -1):
    wait_until(lambda: job.current(replica).poll() is not None, 120,
               f"replica {replica} to die from {inject}")
    assert job.current(replica).returncode == -signal.SIGKILL
    healthy = next(r for r in range(job.replicas) if r != replica)
    wait_until(lambda: job.last_committed_step(healthy) >= restart_after_step, 120,
               f"replica {healthy} to pass step {restart_after_step}")
    job.start(replica)


@pytest.mark.parametrize("point", ["after_commit", "mid_allreduce", "before_commit"])
def test_killed_replica_restarts_catches_up_and_nothing_is_lost(tmp_path, point):
    # Long enough that the healthy replicas still train when the restarted one is back
    # (a Python + torch start takes seconds on a loaded 2-core machine).
    job = loopback_job(tmp_path, replicas=3, steps=LONG_RUN)
    job.start_all({1: f"kill@{point}:12"})
    try:
        kill_and_restart(job, 1, point)
        finish_and_check(job, LONG_RUN)
    finally:
        job.stop_everything()
    for healthy in (0, 2):
        assert_kept_stepping(job, healthy)
        factors = {(e.contributors, round(e.lr_factor, 9)) for e in job.committed(healthy)}
        assert (2, round(math.sqrt(2 / 3), 9)) in factors  # sqrt LR scaling while degraded
    rejoined = [e for e in job.committed(1) if e.caught_up]
    # One catch-up, or a few when the leader formed the next step's quorum before the
    # newcomer had applied the state it fetched (it then fetches one step again).
    assert rejoined and rejoined[0].step > 12
    assert all(e.contributors == 2 for e in rejoined)  # it contributed zeros meanwhile
    after = [e for e in job.committed(1) if e.step > rejoined[-1].step]
    assert after and all(e.contributors == 3 and not e.caught_up for e in after)
    # each replica's term and vote are where its relaunch reads them back
    memories = [MemoryFile(replica_memory_path(job.run_dir, r), "local").load()
                for r in range(3)]
    assert all(m.term >= 1 for m in memories), memories


def test_replica_behind_by_many_steps_catches_up_in_one_fetch(tmp_path):
    job = loopback_job(tmp_path, replicas=3, steps=LONG_RUN)
    job.start_all({2: "kill@after_commit:5"})
    try:
        kill_and_restart(job, 2, "after_commit", restart_after_step=25)
        finish_and_check(job, LONG_RUN)
    finally:
        job.stop_everything()
    rejoins = [e for e in job.committed(2) if e.caught_up]
    assert rejoins and rejoins[0].step >= 26


def test_two_replicas_fail_at_once(tmp_path):
    job = loopback_job(tmp_path, replicas=5, steps=LONG_RUN)
    job.start_all({1: "kill@after_commit:10", 3: "kill@after_commit:10"})
    try:
        for replica in (1, 3):
            kill_and_restart(job, replica, "after_commit")
        finish_and_check(job, LONG_RUN)
    finally:
        job.stop_everything()
    assert any(e.contributors == 3 for e in job.committed(0))
    assert_kept_stepping(job, 0)


def test_every_replica_lost_at_once_trains_on_from_the_persistent_step(tmp_path):
    """No live state is left: two of the three restart first, restore the newest
    persisted step and train the steps after it again without the third, so not as
    they were first trained; the third catches up from them. The audit goes by the
    restores: in the history left nothing is skipped or trained twice, and every
    replica ends identical."""
    # all three in every quorum at first (none left out by a slow start), then two
    job = loopback_job(tmp_path, replicas=3, steps=LONG_RUN, FTL_CKPT_PERSIST_EVERY="10",
                       FTL_QUORUM_MIN_REPLICAS="3")
    job.start_all({r: "kill@after_commit:15" for r in range(3)})
    try:
        for replica in range(3):
            wait_until(lambda r=replica: job.current(r).poll() is not None, 120,
                       f"replica {replica} to die at step 15")
        job.config_env = {**job.config_env, "FTL_QUORUM_MIN_REPLICAS": "2"}
        job.start(0)
        job.start(1)
        wait_until(lambda: len(job.committed(0)) >= 16 + 10, 120,
                   "replicas 0 and 1 to train on without replica 2")
        job.start(2)
        finish_and_check(job, LONG_RUN)
    finally:
        job.stop_everything()
    steps = [e.step for e in job.committed(0)]
    again = steps.index(steps[16])           # the first step after the loss, first time
    assert steps[:16] == list(range(16)) and steps[16] <= 15, steps[:30]
    first, second = job.committed(0)[again], job.committed(0)[16]
    assert (first.contributors, second.contributors) == (3, 2), (first, second)
    summary = check_exactly_once(job.run_dir, 3, LONG_RUN)
    # the lost branch: steps[16]..15, committed by all three
    assert summary.rolled_back == 3 * (16 - steps[16]), (summary, steps[:30])


def hang_resume_and_finish(job: LocalJob, point: str, last_committed: int) -> None:
    """Replica 2 stops (SIGSTOP) at ``point`` of step 10; the others go on; it resumes."""
    job.start_all({2: f"stop@{point}:10"})
    try:
        wait_until(lambda: job.last_committed_step(0) >= 20, 120,
                   "the others to go on without the hung replica")
        assert job.last_committed_step(2) == last_committed
        job.resume(2)
        finish_and_check(job, LONG_RUN)
    finally:
        job.stop_everything()


@pytest.mark.parametrize("ranks", [1, 2])
def test_a_replica_hung_mid_allreduce_is_dropped_within_the_quorum_timeout(tmp_path, ranks):
    """SIGSTOP inside the gradient all-reduce: no FIN reaches the ring. The quorum's
    heartbeats notice (member timeout 1 s) and the survivors' rings fail at once,
    far inside an FTAR timeout of 60 s (with 2 ranks, rank 0 relays it to rank 1)."""
    job = loopback_job(tmp_path, replicas=3, steps=LONG_RUN, ranks=ranks,
                       FTL_FTAR_TIMEOUT="60")
    hang_resume_and_finish(job, "mid_allreduce", last_committed=9)
    for healthy in (0, 1):
        assert_kept_stepping(job, healthy)
    # A survivor whose ring still needed the hung replica's frames gave up on the
    # quorum's word (the other may have had them all and committed).
    discarded = [e for healthy in (0, 1) for e in job.events(healthy)
                 if type(e).__name__ == "StepDiscarded"]
    assert any("reported lost by the quorum" in e.reason for e in discarded), discarded


def test_hung_replica_is_dropped_then_rejoins(tmp_path):
    job = loopback_job(tmp_path, replicas=3, steps=LONG_RUN)
    hang_resume_and_finish(job, "after_commit", last_committed=10)
    assert any(e.caught_up for e in job.committed(2))
    assert_kept_stepping(job, 0)


def test_replicas_of_two_ranks_stay_identical_through_a_replica_failure(tmp_path):
    """FSDP2 replicas of two ranks (the example's default): rank k rings with rank k
    of every replica; the restarted replica fetches its rank-k shards and every
    rank ends with the same shards as the same rank of the other replicas."""
    job = loopback_job(tmp_path, replicas=3, steps=LONG_RUN, ranks=2)
    job.start_all({1: "kill@after_commit:10"})
    try:
        kill_and_restart(job, 1, "after_commit")
        finish_and_check(job, LONG_RUN)
    finally:
        job.stop_everything()
    assert_ranks_agree(tmp_path, replicas=3, ranks=2)
    assert any(e.caught_up for e in job.committed(1))


def test_a_rank_killed_mid_backward_takes_its_replica_down_and_it_returns_by_shards(
        tmp_path):
    """FSDP2 replicas of two ranks. Rank 1 of replica 1 is SIGKILLed inside FTAR in the
    all-reduce hook of its first gradient unit, while backward goes on. As srun's
    --kill-on-bad-exit would, the test then ends the replica's other rank. The other
    replicas commit on; the relaunched replica fetches each rank's shards from the same
    rank of a survivor; every rank ends as the same rank elsewhere, every sample once."""
    job = loopback_job(tmp_path, replicas=3, steps=LONG_RUN, ranks=2)
    job.start_all({1: "kill@mid_allreduce:12/1"})
    try:
        rank0, rank1 = job.procs[1][-1]
        wait_until(lambda: rank1.poll() is not None, 120, "rank 1 of replica 1 to die")
        assert rank1.returncode == -signal.SIGKILL and job.last_committed_step(1) == 11
        rank0.kill()
        rank0.wait(timeout=30)
        wait_until(lambda: job.last_committed_step(0) >= 20, 120, "replica 0 to go on")
        job.start(1)
        finish_and_check(job, LONG_RUN)
    finally:
        job.stop_everything()
    assert_ranks_agree(tmp_path, replicas=3, ranks=2)
    assert any(e.caught_up for e in job.committed(1))
    for healthy in (0, 2):
        assert_kept_stepping(job, healthy)


def test_two_replica_job_waits_for_its_lost_half_then_goes_on(tmp_path):
    """With 2 configured replicas one survivor is no majority: it must wait (paced
    retries), not spend its failure budget at once, and resume when the other is back."""
    job = loopback_job(tmp_path, replicas=2, steps=60)
    job.start_all({1: "kill@after_commit:10"})
    try:
        kill_and_restart(job, 1, "after_commit")
        finish_and_check(job, 60)
    finally:
        job.stop_everything()
    assert "majority needs 2" in job.log(0)
    assert [e.step for e in job.committed(0)] == list(range(60))  # waited; nothing skipped


def test_a_restarted_job_resumes_every_rank_from_the_newest_persistent_step(tmp_path):
    """Every replica stopped (a requeue): the next incarnation's ranks agree on the
    newest step the persistent tier holds for all of them, resume after it, and train
    on to identical states."""
    first = loopback_job(tmp_path, replicas=2, steps=25, ranks=2, FTL_CKPT_PERSIST_EVERY="10")
    first.start_all()
    try:
        finish_and_check(first, 25)
    finally:
        first.stop_everything()
    second = loopback_job(tmp_path, replicas=2, steps=35, ranks=2, FTL_CKPT_PERSIST_EVERY="10")
    started = {(r, k): len(second.events(r, k)) for r in range(2) for k in range(2)}
    second.start_all()
    try:
        codes = second.wait_all(patience(180))
        assert codes == {0: 0, 1: 0}, {r: second.log(r)[-3000:] for r in codes}
    finally:
        second.stop_everything()
    resumed = {e.next_step for (r, k), before in started.items()
               for e in second.events(r, k)[before:] if type(e).__name__ == "WorkerStarted"}
    assert resumed == {21}           # step 20 is the newest persisted: 0, 10, 20
    assert_ranks_agree(tmp_path, replicas=2, ranks=2)


@pytest.mark.parametrize(("parallel", "ranks"), [("fsdp", 2), ("none", 1)])
def test_a_nan_from_one_replica_is_discarded_by_every_replica_and_never_trained(
        tmp_path, parallel, ranks):
    """Silent corruption: one rank of replica 1 contributes a NaN at step 9. Every
    replica finds the same non-finite average, discards step 9 and retries it; no
    weights ever hold the NaN and every sample is trained once."""
    steps = 20
    job = loopback_job(tmp_path, replicas=3, steps=steps, ranks=ranks, parallel=parallel)
    job.start_all(injects={1: f"nan@gradients:9/{ranks - 1}"})
    try:
        finals = finish_and_check(job, steps)
    finally:
        job.stop_everything()
    poisoned_rank = ranks - 1        # its ring found the NaN; it voted its ranks down
    for replica in range(3):
        for rank in range(ranks):
            discarded = [e for e in job.events(replica, rank)
                         if type(e).__name__ == "StepDiscarded"]
            assert [e.step for e in discarded] == [9], (replica, rank, discarded)
            if rank == poisoned_rank:
                assert "NaN or Inf" in discarded[0].reason
            # every rank of a replica names the same nodes: the corrupting rank's only
            assert discarded[0].nonfinite_nodes == ([socket.gethostname()] if replica == 1
                                                    else []), (replica, rank)
            # the one injected value, counted where it was computed
            assert discarded[0].nonfinite_values == (1 if replica == 1 else 0)
            # what every commit tells the controller of the step
            for commit in (e for e in job.events(replica, rank)
                           if type(e).__name__ == "StepCommitted"):
                assert commit.grad_norm is not None and math.isfinite(commit.grad_norm)
                assert commit.grad_norm > 0, commit
                assert 0 <= commit.wait_s <= commit.step_s, commit
    assert all(math.isfinite(f["loss"]) for f in finals.values())
    assert_ranks_agree(tmp_path, replicas=3, ranks=ranks)
