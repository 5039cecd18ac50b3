"""Hot update and rollback of the training code: the decision table and the request files."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from ft_launch.errors import UsageError
from ft_launch.events import EventLog, read_events
from ft_launch.launcher.controller import versions
from ft_launch.launcher.controller.run_state import ReplicaState, RunState

T0 = 1000.0
DIGEST_A = "a" * 64
DIGEST_B = "b" * 64


def request(number=1, command=("python", "train_v2.py"), digest=DIGEST_B, urgent=False,
            window_s=None):
    return versions.UpdateRequest(number=number, command=tuple(command), urgent=urgent,
                                  window_s=window_s, note=f"request {number}", digest=digest,
                                  created=T0)


def running(replicas=3):
    """Every replica launched on version 1 and committing steps."""
    state = RunState.initial(("python", "train.py"), DIGEST_A, range(replicas), T0)
    for r in range(replicas):
        state, _ = versions.decide_version(state, versions.ReplicaLaunching(r), T0)
        state, _ = versions.decide_version(state, versions.ReplicaProgressed(r), T0)
    return state


def step(state, event, now=T0 + 1, policy=None):
    return versions.decide_version(state, event, now, policy)


def restarts(actions):
    return [(a.replica_id, a.version.number) for a in actions
            if isinstance(a, versions.RestartReplicaForUpdate)]


def relaunch(state, replica_id, now=T0 + 1):
    """The shell carries out a restart: the replica launches again and commits a step."""
    state, actions = step(state, versions.ReplicaLaunching(replica_id), now)
    launched = [a for a in actions if isinstance(a, versions.RunVersion)]
    state, more = step(state, versions.ReplicaProgressed(replica_id), now)
    return state, launched[0].version.number, more


# --------------------------------------------------------------------------- launches


def test_first_launch_records_version_1_for_each_replica():
    state = RunState.initial(("python", "train.py"), DIGEST_A, range(2), T0)
    state, actions = step(state, versions.ReplicaLaunching(1))
    assert actions[0] == versions.CodeVersionApplied(replica_id=1, version=1,
                                                     command=["python", "train.py"],
                                                     digest=DIGEST_A, time=T0 + 1)
    assert actions[1] == versions.RunVersion(1, state.version(1))
    assert state.replica(1).state is ReplicaState.STARTING and state.replica(1).version == 1
    # a relaunch on the same version runs it again without a new record
    _, actions = step(state, versions.ReplicaLaunching(1))
    assert actions == [versions.RunVersion(1, state.version(1))]


def test_update_is_applied_at_the_next_relaunch_and_nobody_is_restarted_before_the_window():
    state, actions = step(running(), versions.UpdateRequested(request(window_s=600.0)))
    assert state.current == 2 and state.deadlines == ((2, T0 + 601),)
    assert [type(a) for a in actions] == [versions.CodeUpdateRequested]
    assert actions[0].version == 2 and actions[0].request == 1
    assert actions[0].forced_at == T0 + 601 and actions[0].ignored == ""
    state, actions = step(state, versions.ReplicaFailed(1), T0 + 5)
    assert actions == []
    state, actions = step(state, versions.ReplicaLaunching(1), T0 + 6)
    assert versions.RunVersion(1, state.version(2)) in actions
    assert [a.version for a in actions if isinstance(a, versions.CodeVersionApplied)] == [2]
    state, actions = step(state, versions.ReplicaProgressed(1), T0 + 7)
    assert actions == []
    assert [r.version for r in state.replicas] == [1, 2, 1]
    _, actions = step(state, versions.Tick(), T0 + 600)
    assert restarts(actions) == []


def test_request_without_window_uses_the_policy_window():
    policy = versions.VersionPolicy(update_window=50.0)
    state, _ = step(running(), versions.UpdateRequested(request()), T0 + 1, policy)
    assert state.deadlines == ((2, T0 + 51),)
    state, _ = step(running(), versions.UpdateRequested(request()), T0 + 1)
    assert state.deadlines == ((2, T0 + 1 + versions.DEFAULT_UPDATE_WINDOW),)


# --------------------------------------------------------------------------- rolling restarts


def test_urgent_update_restarts_replicas_one_at_a_time():
    state, actions = step(running(), versions.UpdateRequested(request(urgent=True)))
    assert restarts(actions) == [(0, 2)]
    assert state.restarting == 0
    # nothing else goes while replica 0 is away, however often the clock ticks
    _, actions = step(state, versions.Tick(), T0 + 50)
    assert restarts(actions) == []
    state, actions = step(state, versions.ReplicaLaunching(0))
    assert restarts(actions) == []
    state, actions = step(state, versions.ReplicaProgressed(0))
    assert restarts(actions) == [(1, 2)] and state.restarting == 1
    state, version, actions = relaunch(state, 1)
    assert version == 2 and restarts(actions) == [(2, 2)]
    state, version, actions = relaunch(state, 2)
    assert version == 2 and restarts(actions) == [] and state.restarting is None
    assert [r.version for r in state.replicas] == [2, 2, 2]


def test_rollout_waits_while_another_replica_is_down_for_a_fault():
    state, _ = step(running(), versions.ReplicaFailed(2))
    state, actions = step(state, versions.UpdateRequested(request(urgent=True)))
    assert restarts(actions) == []
    state, actions = step(state, versions.ReplicaLaunching(2))
    assert restarts(actions) == []
    _, actions = step(state, versions.ReplicaProgressed(2))
    assert restarts(actions) == [(0, 2)]


def test_late_commit_of_a_failed_replica_does_not_count_it_as_up():
    state, _ = step(running(2), versions.ReplicaFailed(1))
    state, _ = step(state, versions.ReplicaProgressed(1))      # read after the exit, same poll
    assert state.replica(1).state is ReplicaState.DOWN
    _, actions = step(state, versions.UpdateRequested(request(urgent=True)))
    assert restarts(actions) == []


def test_warm_standby_on_an_old_version_is_restarted_when_the_update_is_due():
    state, _ = step(running(2), versions.UpdateRequested(request(window_s=100.0)), T0)
    state, _ = step(state, versions.ReplicaFailed(1), T0 + 1)
    state, actions = step(state, versions.ReplicaLaunching(1, version=1), T0 + 2)
    assert actions == [versions.RunVersion(1, state.version(1))]
    state, _ = step(state, versions.ReplicaProgressed(1), T0 + 3)
    state, actions = step(state, versions.Tick(), T0 + 100)
    assert restarts(actions) == [(0, 2)]
    state, _, actions = relaunch(state, 0, T0 + 101)
    assert restarts(actions) == [(1, 2)]
    with pytest.raises(ValueError, match="no code version 7"):
        step(state, versions.ReplicaLaunching(1, version=7))


def test_window_expiry_forces_the_rollout_on_tick():
    state, _ = step(running(2), versions.UpdateRequested(request(window_s=100.0)), T0)
    _, actions = step(state, versions.Tick(), T0 + 99.9)
    assert restarts(actions) == []
    state, actions = step(state, versions.Tick(), T0 + 100)
    assert restarts(actions) == [(0, 2)]
    state, _, actions = relaunch(state, 0, T0 + 101)
    assert restarts(actions) == [(1, 2)]


def test_second_update_while_rolling_sends_the_rest_to_the_newest_version():
    state, _ = step(running(), versions.UpdateRequested(request(1, urgent=True)), T0)
    state, actions = step(state, versions.UpdateRequested(
        request(2, ("python", "train_v3.py"), "c" * 64, window_s=1000.0)), T0 + 1)
    assert state.current == 3 and restarts(actions) == []
    # replica 0 was restarted for v2 before v3 existed: its launch now adopts v3
    state, version, actions = relaunch(state, 0, T0 + 2)
    assert version == 3 and restarts(actions) == [(1, 3)]
    state, version, actions = relaunch(state, 1, T0 + 3)
    assert restarts(actions) == [(2, 3)]
    state, version, actions = relaunch(state, 2, T0 + 4)
    assert restarts(actions) == [] and [r.version for r in state.replicas] == [3, 3, 3]


def test_urgent_update_during_a_window_keeps_updated_replicas_until_their_window():
    state, _ = step(running(), versions.UpdateRequested(request(1, window_s=1000.0)), T0)
    state, _ = step(state, versions.ReplicaFailed(1), T0 + 1)
    state, version, _ = relaunch(state, 1, T0 + 2)       # adopted v2 at its recovery
    assert version == 2
    state, actions = step(state, versions.UpdateRequested(
        request(2, ("python", "train_v3.py"), "c" * 64, urgent=True)), T0 + 3)
    assert restarts(actions) == [(0, 3)]
    state, _, actions = relaunch(state, 0, T0 + 4)
    assert restarts(actions) == [(1, 3)]                  # v2 < v3, urgent: due now


def test_same_code_as_current_adds_no_version_but_an_urgent_request_forces_the_rollout():
    state, _ = step(running(2), versions.UpdateRequested(request(1, window_s=1000.0)), T0)
    state, actions = step(state, versions.UpdateRequested(request(2, urgent=True)), T0 + 1)
    assert len(state.versions) == 2 and actions[0].version == 2
    assert restarts(actions) == [(0, 2)]


# --------------------------------------------------------------------------- rollback


def test_repeated_failures_on_a_new_version_roll_it_back():
    state, _ = step(running(2), versions.UpdateRequested(request(urgent=True)), T0)
    state, _ = step(state, versions.ReplicaLaunching(0), T0 + 1)       # restarted onto v2
    state, actions = step(state, versions.ReplicaFailed(0), T0 + 2)
    assert actions == [] and state.current == 2
    state, _ = step(state, versions.ReplicaLaunching(0), T0 + 3)       # recovery retries it: v2
    state, actions = step(state, versions.ReplicaFailed(0), T0 + 4)
    rollback = [a for a in actions if isinstance(a, versions.RollBack)]
    assert rollback == [versions.RollBack(2, 1, rollback[0].reason)]
    assert "replica 0 failed 2 times on code version 2" in rollback[0].reason
    assert [a.to_version for a in actions if isinstance(a, versions.CodeRolledBack)] == [1]
    assert state.current == 1 and state.bad == (2,) and state.deadlines == ()
    # the failed replica is the one restart in flight: it relaunches on v1
    assert restarts(actions) == [] and state.restarting == 0
    state, version, actions = relaunch(state, 0, T0 + 5)
    assert version == 1 and restarts(actions) == []


def test_rollback_restarts_the_other_replicas_on_the_bad_version_one_at_a_time():
    state, _ = step(running(3), versions.UpdateRequested(request(window_s=1000.0)), T0)
    for r in (1, 2):                                     # both adopted v2 at a recovery
        state, _ = step(state, versions.ReplicaFailed(r), T0 + 1)
        state, _, _ = relaunch(state, r, T0 + 2)
    state, _ = step(state, versions.ReplicaFailed(1), T0 + 3)
    state, _ = step(state, versions.ReplicaLaunching(1), T0 + 4)
    state, actions = step(state, versions.ReplicaFailed(1), T0 + 5)
    assert any(isinstance(a, versions.RollBack) for a in actions) and restarts(actions) == []
    state, version, actions = relaunch(state, 1, T0 + 6)
    assert version == 1 and restarts(actions) == [(2, 1)]
    state, version, actions = relaunch(state, 2, T0 + 7)
    assert version == 1 and restarts(actions) == []      # replica 0 never left v1


def test_progress_resets_the_failure_count():
    state, _ = step(running(2), versions.UpdateRequested(request(window_s=1000.0)), T0)
    state, _ = step(state, versions.ReplicaFailed(0), T0 + 1)
    state, _, _ = relaunch(state, 0, T0 + 2)
    state, _ = step(state, versions.ReplicaFailed(0), T0 + 3)
    assert state.replica(0).failures_on_version == 1
    state, _, _ = relaunch(state, 0, T0 + 4)
    assert state.replica(0).failures_on_version == 0
    state, actions = step(state, versions.ReplicaFailed(0), T0 + 5)
    assert actions == [] and state.current == 2 and state.bad == ()


def test_the_initial_version_is_never_rolled_back():
    state = running(1)
    for _ in range(4):
        state, actions = step(state, versions.ReplicaFailed(0))
        assert actions == []
        state, _ = step(state, versions.ReplicaLaunching(0))
    assert state.current == 1 and state.bad == ()


def test_rollback_threshold_is_a_policy():
    policy = versions.VersionPolicy(rollback_after=1)
    state, _ = step(running(1), versions.UpdateRequested(request(urgent=True)), T0, policy)
    state, _ = step(state, versions.ReplicaLaunching(0), T0 + 1, policy)
    _, actions = step(state, versions.ReplicaFailed(0), T0 + 2, policy)
    assert [a.from_version for a in actions if isinstance(a, versions.RollBack)] == [2]


def test_request_for_code_already_rolled_back_is_ignored_and_recorded():
    state, _ = step(running(1), versions.UpdateRequested(request(1, urgent=True)), T0)
    for now in (T0 + 1, T0 + 3):
        state, _ = step(state, versions.ReplicaLaunching(0), now)
        state, _ = step(state, versions.ReplicaFailed(0), now + 1)
    assert state.bad == (2,)
    again, actions = step(state, versions.UpdateRequested(request(2, urgent=True)), T0 + 9)
    assert again == state
    assert actions[0].version is None and "rolled back" in actions[0].ignored


def test_retired_replica_is_not_waited_for():
    state, _ = step(running(2), versions.ReplicaFailed(1))
    state, actions = step(state, versions.UpdateRequested(request(urgent=True)))
    assert restarts(actions) == []
    _, actions = step(state, versions.ReplicaRetired(1))
    assert restarts(actions) == [(0, 2)]


def test_records_round_trip_through_the_event_log(tmp_path):
    state, requested = step(running(1), versions.UpdateRequested(request(urgent=True)))
    _, applied = step(state, versions.ReplicaLaunching(0))
    records = [a for a in requested + applied if isinstance(a, versions.Event)]
    with EventLog(tmp_path / "controller.jsonl") as log:
        for record in records:
            log.emit(record)
    assert list(read_events(tmp_path / "controller.jsonl")) == records
    assert [type(r).__name__ for r in records] == ["CodeUpdateRequested", "CodeVersionApplied"]


# --------------------------------------------------------------------------- files and digests


def test_request_files_are_numbered_and_read_back_in_order(tmp_path):
    (tmp_path / "train.py").write_text("print('v2')\n")
    (tmp_path / "run").mkdir()
    first = versions.write_update_request(tmp_path / "run", ["python", "train.py"], urgent=True,
                                          window_s=None, note="fix nan", cwd=tmp_path, now=5.0)
    second = versions.write_update_request(tmp_path / "run", ["python", "train.py", "--lr=1"],
                                           urgent=False, window_s=60.0, note="", cwd=tmp_path)
    assert (tmp_path / "run" / "updates" / "0001.json").is_file()
    assert sorted(p.name for p in (tmp_path / "run" / "updates").iterdir()) == ["0001.json",
                                                                                 "0002.json"]
    assert versions.read_update_requests(tmp_path / "run") == [first, second]
    assert versions.read_update_requests(tmp_path / "run", after=1) == [second]
    assert first.number == 1 and first.urgent and first.created == 5.0
    assert first.digest == versions.digest_command(["python", "train.py"], tmp_path)
    assert second.window_s == 60.0 and second.command == ("python", "train.py", "--lr=1")


def test_two_writers_that_pick_the_same_number_both_land(tmp_path, monkeypatch):
    monkeypatch.setattr(versions, "_request_files", lambda directory: [])   # both saw no file yet
    first = versions.write_update_request(tmp_path, ["a"], urgent=False, window_s=None, note="1")
    second = versions.write_update_request(tmp_path, ["b"], urgent=False, window_s=None, note="2")
    assert (first.number, first.note, second.number, second.note) == (1, "1", 2, "2")
    assert sorted(p.name for p in (tmp_path / "updates").iterdir()) == ["0001.json", "0002.json"]


def test_writer_refuses_bad_input(tmp_path):
    with pytest.raises(UsageError, match="non-empty command"):
        versions.write_update_request(tmp_path, [], urgent=False, window_s=None, note="")
    with pytest.raises(UsageError, match="window"):
        versions.write_update_request(tmp_path, ["x"], urgent=False, window_s=-1.0, note="")
    with pytest.raises(UsageError, match="does not exist"):
        versions.write_update_request(tmp_path / "nope", ["x"], urgent=False, window_s=None,
                                      note="")
    assert not (tmp_path / "updates").exists() and not (tmp_path / "nope").exists()


GOOD = {"command": ["python", "train.py"], "urgent": False, "window_s": 10, "note": "",
        "digest": "0" * 64, "created": 1.0}


@pytest.mark.parametrize("change, field, words", [
    ({"command": []}, "command", "non-empty list"),
    ({"command": ["python", 3]}, "command", "non-empty list"),
    ({"urgent": "yes"}, "urgent", "true or false"),
    ({"window_s": -5}, "window_s", ">= 0"),
    ({"window_s": True}, "window_s", ">= 0"),
    ({"digest": "xyz"}, "digest", "sha256"),
    ({"created": None}, "created", "seconds"),
    ({"urgnet": True}, "urgnet", "valid: ['command'"),
])
def test_bad_request_file_names_the_file_and_the_field(tmp_path, change, field, words):
    path = tmp_path / "updates" / "0003.json"
    path.parent.mkdir()
    path.write_text(json.dumps({**GOOD, **change}))
    with pytest.raises(versions.UpdateRequestError) as caught:
        versions.read_update_requests(tmp_path)
    message = str(caught.value)
    assert str(path) in message and f"key '{field}'" in message and words in message


def test_missing_field_and_broken_json_are_named(tmp_path):
    path = tmp_path / "updates" / "0001.json"
    path.parent.mkdir()
    path.write_text(json.dumps({k: v for k, v in GOOD.items() if k != "note"}))
    with pytest.raises(versions.UpdateRequestError, match=r"0001.json, key 'note': missing"):
        versions.read_update_requests(tmp_path)
    path.write_text('{"command": ["py"')
    with pytest.raises(versions.UpdateRequestError, match=r"0001.json: not readable as JSON"):
        versions.read_update_requests(tmp_path)


def test_digest_changes_with_the_script_contents_and_the_arguments(tmp_path):
    script = tmp_path / "train.py"
    script.write_text("lr = 0.1\n")
    command = ["python", "train.py", "--steps", "10"]
    before = versions.digest_command(command, tmp_path)
    assert versions.digest_command(command, tmp_path) == before
    script.write_text("lr = 0.2\n")
    after = versions.digest_command(command, tmp_path)
    assert after != before
    assert versions.digest_command(["python", "train.py", "--steps", "11"], tmp_path) != after
    # a file named in --flag=value counts too; an absolute path resolves without cwd
    config = tmp_path / "conf.toml"
    config.write_text("a = 1\n")
    flagged = versions.digest_command(["python", f"--config={config}"], Path("/"))
    config.write_text("a = 2\n")
    assert versions.digest_command(["python", f"--config={config}"], Path("/")) != flagged
    # argv boundaries count: ["ab", "c"] is not ["a", "bc"]
    assert (versions.digest_command(["ab", "c"], tmp_path)
            != versions.digest_command(["a", "bc"], tmp_path))
