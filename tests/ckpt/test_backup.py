"""Peer backup wired: placement over a quorum's members, the sender following it,
held backups kept as node-local files that outlive their process, and a restart
that restores from them when no replica's process is left."""

from __future__ import annotations

import multiprocessing
import os
import signal
from pathlib import Path

import numpy as np
import pytest

from ft_launch.ckpt.backup import RETARGET_TRIES, BackupSender, BackupStore
from ft_launch.ckpt.errors import NoCheckpointError
from ft_launch.ckpt.fetch import Peer, fetch_state, push_backup
from ft_launch.ckpt.held import HeldCopy, HeldFiles
from ft_launch.ckpt.placement import PlacementRule, global_rank, route_backups
from ft_launch.ckpt.restore import PeerCopy, PeerTier, RestoreChain, TierKind, peer_copies
from ft_launch.ckpt.serve import StateServer
from ft_launch.ckpt.snapshot import DualBufferSnapshotter
from ft_launch.ids import new_job_secret

from . import backup_proc
from .helpers import assert_state_equal, snapshot_of

pytestmark = pytest.mark.timeout(120)
SECRET = new_job_secret()


def members(hosts: list[list[str]]) -> tuple[tuple[int, tuple[tuple[str, int], ...]], ...]:
    """Quorum members: replica r's ranks on ``hosts[r]`` (distinct ports)."""
    return tuple((replica, tuple((host, 9000 + 10 * replica + rank)
                                 for rank, host in enumerate(ranks)))
                 for replica, ranks in enumerate(hosts))


# ---------------------------------------------------------------------- placement (pure)


def test_one_rank_replicas_back_up_to_the_next_replica_node():
    view = members([["10.0.0.1"], ["10.0.0.2"], ["10.0.0.3"]])
    routes = [route_backups(view, replica, 0) for replica in range(3)]
    assert [r.rule for r in routes] == [PlacementRule.NEIGHBOUR_NODE] * 3
    assert [r.send_to for r in routes] == [("10.0.0.2", 9010), ("10.0.0.3", 9020),
                                           ("10.0.0.1", 9000)]
    # every source is taken by exactly the rank it sends to
    for source, route in enumerate(routes):
        assert route.holder is not None and source in routes[route.holder].accept_from
    assert [r.accept_from for r in routes] == [{2}, {0}, {1}]


def test_sharded_replicas_back_up_across_replica_and_shard():
    """Two ranks per replica on one node each: the backup of (replica, shard) is on
    another replica's node, and with another shard (it shares no group)."""
    view = members([["h0", "h0"], ["h1", "h1"], ["h2", "h2"]])
    for replica in range(3):
        for shard in range(2):
            route = route_backups(view, replica, shard)
            assert route.rule is PlacementRule.CROSS_GROUP
            assert route.send_to is not None and route.send_to[0] != f"h{replica}"
            assert route.holder is not None and route.holder % 2 != shard
            held_by_holder = route_backups(view, route.holder // 2, route.holder % 2)
            assert global_rank(replica, shard, 2) in held_by_holder.accept_from


def test_placement_follows_the_members_not_the_configured_replicas():
    """Replica 1 is out of the quorum: 0 and 2 back each other up."""
    view = tuple(m for m in members([["a"], ["b"], ["c"]]) if m[0] != 1)
    assert route_backups(view, 0, 0).holder == 2
    assert route_backups(view, 2, 0).holder == 0


@pytest.mark.parametrize(("hosts", "why"), [
    ([["127.0.0.1"], ["127.0.0.1"]], "at least two nodes"),
    ([["a", "a"], ["b"]], "different numbers of ranks"),
])
def test_no_backup_rank_says_why(hosts, why):
    route = route_backups(members(hosts), 0, 0)
    assert route.send_to is None and route.accept_from == frozenset()
    assert why in route.why_none


def test_copies_of_a_shard_are_listed_once_per_node_newest_first():
    copies = [HeldCopy(5, 0, 40, 1, 100), HeldCopy(5, 1, 45, 1, 100), HeldCopy(4, 0, 45, 0, 100)]
    gathered = [("n0", Peer("h0", 1), copies), ("n0", Peer("h0", 2), copies),
                ("n1", Peer("h1", 3), [HeldCopy(9, 0, 45, 1, 100)])]
    assert peer_copies(gathered, shard=1) == [
        PeerCopy(Peer("h0", 1), 5, 45), PeerCopy(Peer("h0", 1), 5, 40),
        PeerCopy(Peer("h1", 3), 9, 45)]
    assert peer_copies(gathered, shard=0) == [PeerCopy(Peer("h0", 1), 4, 45)]


# ---------------------------------------------------------------------- held files


def test_a_held_backup_outlives_its_store_and_is_served_by_the_next(tmp_path):
    """The receiving store writes the backup into its node's files; a new store on
    the same directory (the next process) lists it and serves it, verified."""
    files = HeldFiles.open(str(tmp_path), "job1", "n3")
    assert files is not None and files.root == tmp_path / "ftl-backup-job1-n3"
    assert files.root.stat().st_mode & 0o777 == 0o700
    sent = snapshot_of(6)
    with StateServer(secret=SECRET, host="127.0.0.1", snapshots=DualBufferSnapshotter().buffers,
                     backups=BackupStore(accept_from={4}, files=files)) as first, \
            sent.lease() as snap:
        push_backup(Peer(*first.address), SECRET, snap, source_rank=4)
    with sent.lease() as snap:
        assert files.copies() == [HeldCopy(4, 0, 6, 0, snap.manifest.total_bytes)]
    again = HeldFiles.open(str(tmp_path), "job1", "n3")
    with StateServer(secret=SECRET, host="127.0.0.1", snapshots=DualBufferSnapshotter().buffers,
                     backups=BackupStore(files=again)) as second:
        fetched = fetch_state(Peer(*second.address), SECRET, backup_of=4, timeout=10)
    assert_state_equal((fetched.manifest, fetched.buffer), 6)


def test_a_push_rewrites_the_older_slot_and_keeps_the_newest(tmp_path):
    files = HeldFiles.open(str(tmp_path), "job1", "n0")
    assert files is not None
    store = BackupStore(files=files)
    with StateServer(secret=SECRET, host="127.0.0.1", snapshots=DualBufferSnapshotter().buffers,
                     backups=store) as server:
        snaps = DualBufferSnapshotter()
        for step in (1, 2, 3):
            snapshot_of(step, snaps)
            with snaps.lease() as snap:
                push_backup(Peer(*server.address), SECRET, snap, source_rank=0)
    assert sorted(c.step for c in files.copies()) == [2, 3]
    adopted = BackupStore(files=HeldFiles(files.root)).buffers(0)
    assert adopted.complete_steps() == [2, 3] and adopted.latest_step() == 3


def test_a_torn_held_file_is_skipped_by_the_restore(tmp_path):
    """A file whose bytes changed after its manifest was written fails the CRC: the
    chain says so and takes the next candidate."""
    files = HeldFiles.open(str(tmp_path), "job1", "n0")
    assert files is not None
    with StateServer(secret=SECRET, host="127.0.0.1", snapshots=DualBufferSnapshotter().buffers,
                     backups=BackupStore(files=files)) as server:
        snaps = DualBufferSnapshotter()
        for step in (1, 2):
            snapshot_of(step, snaps)
            with snaps.lease() as snap:
                push_backup(Peer(*server.address), SECRET, snap, source_rank=0)
    newest = next(c for c in files.copies() if c.step == 2)
    with open(files.bin_path(0, newest.slot), "r+b") as handle:
        handle.seek(100)
        handle.write(b"\xff" * 16)
    with StateServer(secret=SECRET, host="127.0.0.1", snapshots=DualBufferSnapshotter().buffers,
                     backups=BackupStore(files=HeldFiles(files.root))) as server:
        copies = [PeerCopy(Peer(*server.address), c.source, c.step) for c in files.copies()]
        restored = RestoreChain([PeerTier(copies, SECRET, timeout=10)], rank=0).restore()
    assert (restored.tier, restored.step) == (TierKind.PEER, 1)
    assert any("step 2" in reason and "verification" in reason for reason in restored.skipped)


@pytest.mark.parametrize("unsafe", ["open_mode", "symlink"])
def test_a_directory_that_is_not_safely_ours_is_not_used(tmp_path, unsafe):
    root = tmp_path / "ftl-backup-job1-n0"
    if unsafe == "open_mode":
        root.mkdir(mode=0o755)
        root.chmod(0o755)
    else:
        (tmp_path / "elsewhere").mkdir(mode=0o700)
        root.symlink_to(tmp_path / "elsewhere")
    assert HeldFiles.open(str(tmp_path), "job1", "n0") is None
    assert HeldFiles.open("", "job1", "n0") is None


def test_a_job_that_reuses_an_id_does_not_find_another_jobs_backups(tmp_path):
    """Same job id and node, another run directory (a Slurm whose ids started over):
    another directory. The same run directory (a requeue): the same one."""
    first = HeldFiles.open(str(tmp_path), "8", "n3", "/runs/a/8")
    again = HeldFiles.open(str(tmp_path), "8", "n3", "/runs/a/8")
    other = HeldFiles.open(str(tmp_path), "8", "n3", "/runs/b/8")
    assert first is not None and again is not None and other is not None
    assert first.root == again.root != other.root


def test_an_unsafe_node_name_stays_inside_the_backup_dir(tmp_path):
    files = HeldFiles.open(str(tmp_path), "../job", "../../n0")
    assert files is not None and files.root.parent == tmp_path


def test_backups_no_longer_placed_here_go_once_a_placed_one_arrives(tmp_path):
    files = HeldFiles.open(str(tmp_path), "job1", "n0")
    assert files is not None
    store = BackupStore(accept_from={1}, files=files)
    with StateServer(secret=SECRET, host="127.0.0.1", snapshots=DualBufferSnapshotter().buffers,
                     backups=store) as server:
        peer = Peer(*server.address)
        with snapshot_of(3).lease() as snap:
            push_backup(peer, SECRET, snap, source_rank=1)
        store.accept({2})                  # a new quorum: 2 is placed here, 1 is not
        assert store.buffers(1).latest_step() == 3  # kept: it may be the newest copy
        with snapshot_of(4).lease() as snap:
            with pytest.raises(Exception, match="not the backup rank"):
                push_backup(peer, SECRET, snap, source_rank=1)
            push_backup(peer, SECRET, snap, source_rank=2)
    assert [c.source for c in files.copies()] == [2]
    with pytest.raises(NoCheckpointError):
        store.buffers(1)


# ---------------------------------------------------------------------- sender


def test_the_sender_follows_the_placement_and_pushes_at_once_after_a_change():
    """Every ``every`` steps; after a retarget the next snapshot goes to the new
    holder whatever its step."""
    first, second = BackupStore(), BackupStore()
    snaps = DualBufferSnapshotter()
    with StateServer(secret=SECRET, host="127.0.0.1", snapshots=snaps.buffers,
                     backups=first) as one, \
            StateServer(secret=SECRET, host="127.0.0.1", snapshots=snaps.buffers,
                        backups=second) as two:
        sender = BackupSender(snaps.buffers, None, SECRET, rank=0, every=10,
                              poll_interval=0.05).start()
        try:
            snapshot_of(9, snaps)       # there is nowhere to send it yet
            sender.retarget(Peer(*one.address))
            snapshot_of(11, snaps)      # sent: the holder is new (or 9 was, and 10 passed)
            assert sender.wait_sent(11, timeout=20)
            snapshot_of(12, snaps)      # neither due nor new: not sent
            snapshot_of(20, snaps)
            assert sender.wait_sent(20, timeout=20)
            assert first.buffers(0).complete_steps() == [11, 20]
            sender.retarget(Peer(*two.address))
            snapshot_of(21, snaps)
            assert sender.wait_sent(21, timeout=20)
            assert second.buffers(0).complete_steps() == [21]
            assert sender.sent in (3, 4) and sender.failed == 0
        finally:
            sender.close()
    assert RETARGET_TRIES >= 1


# ---------------------------------------------------------------------- processes


def test_every_replica_lost_at_once_restores_from_the_peer_copy_on_its_node(tmp_path):
    """Two replicas, each rank in its own process on its own 'node' (loopback address
    and node directory), back each other up every 3 steps; both are SIGKILLed. The
    next incarnation of replica 0, on node n0, finds replica 1's backup there and
    restores it: the newest step pushed, not the persistent tier's (none)."""
    (tmp_path / "secret").write_text(SECRET)
    (tmp_path / "shm").mkdir()            # the nodes' tmpfs (ckpt.backup_dir)
    context = multiprocessing.get_context("spawn")
    hosts = {0: ("127.0.0.2", "n0"), 1: ("127.0.0.3", "n1")}
    procs, conns = [], []
    try:
        for replica, (host, node) in hosts.items():
            parent, child = context.Pipe()
            proc = context.Process(target=backup_proc.train, args=(
                child, str(tmp_path), replica, 2, host, node, 11, 3), daemon=True)
            proc.start()
            procs.append(proc)
            conns.append(parent)
        addresses = [conn.recv() for conn in conns]
        view = tuple((replica, ((a.host, a.port),)) for replica, a in enumerate(addresses))
        for conn in conns:
            conn.send(view)
        assert [conn.recv() for conn in conns] == [9, 9]      # steps 0, 3, 6, 9 pushed
        for conn in conns:
            conn.send("list")
        held = [conn.recv() for conn in conns]
        # each node holds the other replica's newest two
        assert sorted((c.source, c.step) for c in held[0]) == [(1, 6), (1, 9)]
        assert sorted((c.source, c.step) for c in held[1]) == [(0, 6), (0, 9)]
    finally:
        for proc in procs:
            if proc.is_alive():
                os.kill(proc.pid, signal.SIGKILL)   # the whole job is lost at once
            proc.join(30)
    assert [p.exitcode for p in procs] == [-signal.SIGKILL] * 2
    parent, child = context.Pipe()
    proc = context.Process(target=backup_proc.restore, args=(
        child, str(tmp_path), 0, 2, *hosts[0]), daemon=True)
    proc.start()
    try:
        assert parent.poll(60), "the restarted rank did not report"
        tier, step, same = parent.recv()
    finally:
        proc.join(30)
    assert (tier, step, same) == (TierKind.PEER.value, 9, True)


def test_held_files_are_node_local_directories(tmp_path):
    """Two nodes of one job never read each other's directory (the lab cluster's
    nodes share one file system; a real node's tmpfs is its own anyway)."""
    one = HeldFiles.open(str(tmp_path), "job1", "n0")
    two = HeldFiles.open(str(tmp_path), "job1", "n1")
    assert one is not None and two is not None and one.root != two.root
    buffer = one.allocate(3, 0, 4096)
    buffer[:] = 7
    assert two.copies() == [] and not any(two.root.iterdir())
    assert np.all(np.fromfile(one.bin_path(3, 0), dtype=np.uint8) == 7)
    assert Path(one.bin_path(3, 0)).stat().st_mode & 0o777 == 0o600


def test_backup_settings_come_from_the_config_and_a_relative_dir_is_refused():
    from ft_launch.config import load_config
    from ft_launch.errors import ConfigError

    config = load_config(None, env={"FTL_CKPT_BACKUP_EVERY": "7",
                                    "FTL_CKPT_BACKUP_DIR": "/var/tmp"})
    assert (config.ckpt.backup_every, config.ckpt.backup_dir) == (7, "/var/tmp")
    with pytest.raises(ConfigError, match="ckpt.backup_dir.*absolute"):
        load_config(None, env={"FTL_CKPT_BACKUP_DIR": "shm"})
