"""``PendingQuorum``: the answer handle ``request_quorum`` returns behaves as the
``concurrent.futures.Future`` it stands in for, across threads."""

from __future__ import annotations

import threading
from concurrent.futures import CancelledError

import pytest

from ft_launch.launcher.quorum import PendingQuorum, Quorum, QuorumMember, QuorumStoppedError

pytestmark = pytest.mark.timeout(60)


def a_quorum() -> Quorum:
    return Quorum.of(7, (QuorumMember(0, 3, "tcp://127.0.0.1:1"),), term=1, leader_id=0)


def test_a_waiter_in_another_thread_gets_the_answer_once_it_is_settled() -> None:
    pending, got, asking = PendingQuorum(), [], threading.Event()

    def wait() -> None:
        asking.set()
        got.append(pending.result(30))

    waiters = [threading.Thread(target=wait) for _ in range(3)]
    for waiter in waiters:
        waiter.start()
    asking.wait(30)
    assert not pending.done()
    quorum = a_quorum()
    pending.settle(quorum)
    for waiter in waiters:
        waiter.join(30)
    assert got == [quorum] * 3
    assert pending.done() and not pending.cancelled() and pending.exception() is None


def test_an_unanswered_request_times_out_as_a_future_does() -> None:
    with pytest.raises(TimeoutError):
        PendingQuorum().result(0.01)
    with pytest.raises(TimeoutError):
        PendingQuorum().exception(0)


def test_an_error_is_raised_to_the_caller_and_returned_by_exception() -> None:
    pending = PendingQuorum()
    error = QuorumStoppedError("stopped")
    pending.settle(error)
    assert pending.exception() is error
    with pytest.raises(QuorumStoppedError):
        pending.result()


def test_cancelled_it_takes_no_answer_and_raises_cancelled() -> None:
    pending = PendingQuorum()
    assert pending.cancel() and pending.cancel() and pending.cancelled() and pending.done()
    pending.settle(a_quorum())
    with pytest.raises(CancelledError):
        pending.result(1)
    settled = PendingQuorum()
    settled.settle(a_quorum())
    assert not settled.cancel() and not settled.cancelled()


def test_callbacks_run_once_when_settled_or_at_once_when_already_done() -> None:
    pending, calls = PendingQuorum(), []
    pending.add_done_callback(calls.append)
    pending.add_done_callback(lambda _: 1 / 0)  # a failing callback spares the others
    pending.add_done_callback(calls.append)
    assert calls == []
    pending.settle(a_quorum())
    pending.settle(a_quorum())
    assert calls == [pending, pending]
    pending.add_done_callback(calls.append)
    assert calls == [pending] * 3
