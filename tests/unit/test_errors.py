import pytest

from ft_launch.errors import (
    ExitCode,
    FatalError,
    NodeUnhealthyError,
    RecoverableError,
    TerminalAbort,
    exit_code_for,
)
from ft_launch.slurm.states import (
    JOB_DISPOSITION,
    Disposition,
    JobState,
    NodeState,
    node_disposition,
)


def test_error_carries_ids_and_hint():
    error = RecoverableError("peer closed", hint="re-form the quorum", replica_id=2, step=17)
    assert "peer closed" in str(error)
    assert "replica_id=2" in str(error) and "step=17" in str(error)
    assert str(error).endswith("re-form the quorum")
    error.with_ids(quorum_id=4, node="n3")
    assert "quorum_id=4" in str(error) and "node=n3" in str(error)
    assert isinstance(error, RecoverableError)


def test_exit_codes_by_class():
    assert exit_code_for(RecoverableError("x")) is ExitCode.RECOVERABLE
    assert exit_code_for(NodeUnhealthyError("x", node="n1")) is ExitCode.NODE_UNHEALTHY
    assert exit_code_for(FatalError("x")) is ExitCode.FATAL_NO_REQUEUE
    assert exit_code_for(ValueError("bug")) is ExitCode.FATAL_NO_REQUEUE
    assert exit_code_for(TerminalAbort("stop")) is ExitCode.ABORTED


def test_terminal_abort_escapes_except_exception():
    def user_code():
        try:
            raise TerminalAbort("controller ordered stop")
        except Exception:  # what training scripts do
            return "swallowed"

    with pytest.raises(TerminalAbort):
        user_code()


def test_every_job_state_has_a_disposition():
    assert set(JOB_DISPOSITION) == set(JobState)
    for state in (JobState.PREEMPTED, JobState.TIMEOUT):
        assert JOB_DISPOSITION[state] is Disposition.RECOVERABLE
    assert JOB_DISPOSITION[JobState.NODE_FAIL] is Disposition.NODE_UNHEALTHY
    assert JOB_DISPOSITION[JobState.RUNNING] is Disposition.ACTIVE


def test_job_state_parse_tolerates_suffixes():
    assert JobState.parse("CANCELLED by 0") is JobState.CANCELLED
    assert JobState.parse("") is JobState.UNKNOWN
    assert JobState.parse("SOMETHING_NEW") is JobState.UNKNOWN


def test_node_disposition():
    assert node_disposition(NodeState.IDLE, frozenset()) is Disposition.ACTIVE
    assert node_disposition(NodeState.IDLE, frozenset({"DRAIN"})) is Disposition.NODE_UNHEALTHY
    assert node_disposition(NodeState.DOWN, frozenset()) is Disposition.NODE_UNHEALTHY
    assert node_disposition(NodeState.MIXED, frozenset({"NOT_RESPONDING"})) \
        is Disposition.NODE_UNHEALTHY
