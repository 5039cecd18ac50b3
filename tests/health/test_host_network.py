"""Host and network checks against test roots, simulated faults and real processes
and sockets on loopback; the kernel-log XID parser."""

import json
import os
import socket
import subprocess
import sys

import pytest

from ft_launch.health import host_checks, network_checks, xid
from ft_launch.health.catalog import bind
from ft_launch.health.context import CheckContext, JobFacts
from ft_launch.health.host_facts import HostFacts
from ft_launch.health.result import CheckStatus
from ft_launch.health.settings import parse_settings
from ft_launch.health.simulation import SimulatedHostFacts, parse_faults

GiB = 1 << 30


def ctx(tmp_path=None, faults=(), **kw):
    """The real host's facts (/proc and /sys under ``tmp_path``), or with ``faults`` injected."""
    roots = {"proc_root": tmp_path, "sys_root": tmp_path} if tmp_path else {}
    host = SimulatedHostFacts(faults=parse_faults(list(faults)), **roots) if faults \
        else HostFacts(**roots)
    return CheckContext(node="n1", host=host, **kw)


def write_meminfo(root, available_kb, swap_total_kb=0, swap_free_kb=0):
    (root / "meminfo").write_text(f"MemTotal: 16000000 kB\nMemAvailable: {available_kb} kB\n"
                                  f"SwapTotal: {swap_total_kb} kB\nSwapFree: {swap_free_kb} kB\n")


def test_memory_and_swap(tmp_path):
    write_meminfo(tmp_path, 100 * 1024, swap_total_kb=2 * 1024 * 1024, swap_free_kb=0)
    result = host_checks.memory("memory", ctx(tmp_path), host_checks.MemoryParams())
    assert (result.status, result.reason) == (CheckStatus.FAIL, "memory available 100MiB<512MiB")
    write_meminfo(tmp_path, 4 * 1024 * 1024, swap_total_kb=2 * 1024 * 1024, swap_free_kb=0)
    params = host_checks.MemoryParams(max_swap_used_bytes=GiB)
    result = host_checks.memory("memory", ctx(tmp_path), params)
    assert (result.status, result.reason) == (CheckStatus.FAIL, "swap used 2GiB")
    assert host_checks.memory("memory", ctx(tmp_path), host_checks.MemoryParams()).status \
        is CheckStatus.PASS


def test_disk_full_missing_and_readonly(tmp_path):
    params = host_checks.DiskParams(paths=("/", str(tmp_path / "absent")), min_free_bytes=1)
    result = host_checks.disk("disk", ctx(), params)
    assert result.status is CheckStatus.FAIL and "absent unusable" in result.reason
    full = ctx(faults=[{"disk_free_bytes": 0, "path": "/"}])
    result = host_checks.disk("disk", full, host_checks.DiskParams(paths=("/",)))
    assert result.reason == "disk / free 0B<1GiB"
    writable = host_checks.WritableParams(paths=("/", str(tmp_path)))
    assert host_checks.writable("writable", ctx(), writable).status is CheckStatus.PASS
    readonly = ctx(faults=[{"readonly": str(tmp_path)}])
    assert host_checks.writable("writable", readonly, writable).reason == f"{tmp_path} read-only"


def test_shm_and_mounts(tmp_path):
    assert host_checks.shm("shm", ctx(), host_checks.ShmParams(min_free_bytes=1)).status \
        is CheckStatus.PASS
    result = host_checks.shm("shm", ctx(), host_checks.ShmParams(min_free_bytes=1 << 60))
    assert result.status is CheckStatus.FAIL and result.reason.startswith("/dev/shm free")
    params = host_checks.MountParams(required=("/proc", str(tmp_path)))
    assert host_checks.mounts("mounts", ctx(), params).reason == f"mount {tmp_path} missing"


def test_load_per_cpu(tmp_path):
    (tmp_path / "loadavg").write_text(f"{64 * (os.cpu_count() or 1)} 1.0 1.0 1/100 1\n")
    result = host_checks.load("load", ctx(tmp_path), host_checks.LoadParams())
    assert result.status is CheckStatus.FAIL and result.reason == "load 64.0/cpu>2"


@pytest.mark.timeout(30)
def test_leftover_processes_of_the_ended_job_are_found():
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"],
                             env={**os.environ, "SLURM_JOB_ID": "987654"})
    try:
        params = host_checks.LeftoverParams()
        ended = ctx(job=JobFacts("987654", ended=True))
        result = host_checks.leftover_processes("leftover_processes", ended, params)
        assert result.status is CheckStatus.FAIL
        assert result.reason == "1 leftover procs of job 987654"
        assert result.evidence["pids"] == [child.pid]
        other = ctx(job=JobFacts("111", ended=True))
        assert host_checks.leftover_processes("l", other, params).status is CheckStatus.PASS
        # Before a job on an exclusive node, another job's process is a leftover too.
        starting = ctx(job=JobFacts("111", ended=False))
        exclusive = host_checks.LeftoverParams(exclusive=True)
        assert host_checks.leftover_processes("l", starting, exclusive).status \
            is CheckStatus.FAIL
    finally:
        child.kill()
        child.wait()


@pytest.mark.timeout(30)
def test_a_hook_running_for_the_job_is_not_a_leftover():
    """Another node's Epilog for the same job (several slurmd on one host) carries
    SLURM_JOB_ID but also SLURM_SCRIPT_CONTEXT: not a process of the job."""
    hook = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"],
                            env={**os.environ, "SLURM_JOB_ID": "987655",
                                 "SLURM_SCRIPT_CONTEXT": "epilog_slurmd"})
    try:
        ended = ctx(job=JobFacts("987655", ended=True))
        result = host_checks.leftover_processes("l", ended, host_checks.LeftoverParams())
        assert result.status is CheckStatus.PASS, result
    finally:
        hook.kill()
        hook.wait()


def test_zombies_counted_from_proc(tmp_path):
    for pid, state in ((10, "Z"), (11, "Z"), (12, "S")):
        (tmp_path / str(pid)).mkdir()
        (tmp_path / str(pid) / "stat").write_text(f"{pid} (a b) {state} 1 1 1\n")
    result = host_checks.zombies("zombies", ctx(tmp_path), host_checks.ZombieParams(max_zombies=1))
    assert (result.status, result.reason) == (CheckStatus.FAIL, "zombies 2>1")


def test_clock_sanity():
    result = host_checks.clock("clock", ctx(), host_checks.ClockParams(min_year=9999))
    assert result.status is CheckStatus.FAIL and "year" in result.reason
    result = host_checks.clock("clock", ctx(), host_checks.ClockParams())
    assert result.status in (CheckStatus.PASS, CheckStatus.WARN)


def make_sysfs(root):
    for name, state, carrier in (("eth0", "up", "1"), ("eth1", "down", "0"),
                                 ("veth0", "unknown", "1")):
        (root / "class/net" / name).mkdir(parents=True)
        (root / "class/net" / name / "operstate").write_text(state + "\n")
        (root / "class/net" / name / "carrier").write_text(carrier + "\n")
    for port, state, phys in (("1", "4: ACTIVE", "5: LinkUp"), ("2", "1: DOWN", "3: Disabled")):
        base = root / "class/infiniband/mlx5_0/ports" / port
        base.mkdir(parents=True)
        (base / "state").write_text(state + "\n")
        (base / "phys_state").write_text(phys + "\n")
        (base / "rate").write_text("200 Gb/sec (4X HDR)\n")


def test_links_and_infiniband_from_sysfs(tmp_path):
    make_sysfs(tmp_path)
    links = network_checks.LinkParams(interfaces=("eth0", "veth0"))
    assert network_checks.links("links", ctx(tmp_path), links).status is CheckStatus.PASS
    links = network_checks.LinkParams(interfaces=("eth0", "eth1", "eth9"))
    result = network_checks.links("links", ctx(tmp_path), links)
    assert result.evidence["problems"] == ["eth1 down", "eth9 missing"]
    result = network_checks.infiniband("ib", ctx(tmp_path), network_checks.IbParams())
    assert result.reason == "ib mlx5_0/2 DOWN/Disabled"
    one = network_checks.IbParams(ports=("mlx5_0/1",))
    assert network_checks.infiniband("ib", ctx(tmp_path), one).status is CheckStatus.PASS
    simulated = ctx(tmp_path, faults=[{"ib_port_down": "mlx5_0/1"}])
    assert network_checks.infiniband("ib", simulated, one).reason == "ib mlx5_0/1 DOWN"
    fast = network_checks.IbParams(ports=("mlx5_0/1",), min_rate_gbps=400)
    assert "rate 200<400" in network_checks.infiniband("ib", ctx(tmp_path), fast).reason


def test_no_infiniband_is_skipped(tmp_path):
    result = network_checks.infiniband("ib", ctx(tmp_path), network_checks.IbParams())
    assert result.status is CheckStatus.PASS and result.evidence["skipped"]


def test_peers_reachable_on_loopback():
    with socket.socket() as server, socket.socket() as closed:
        server.bind(("127.0.0.1", 0))
        server.listen()
        closed.bind(("127.0.0.1", 0))  # bound, never listening: connection refused
        live = f"127.0.0.1:{server.getsockname()[1]}"
        dead = f"127.0.0.1:{closed.getsockname()[1]}"
        params = network_checks.PeerParams(targets=(live, dead), connect_timeout=2.0)
        result = network_checks.peers("peers", ctx(), params)
    assert result.status is CheckStatus.FAIL
    assert result.reason.startswith(f"peer {dead} unreachable")


@pytest.fixture
def listening():
    """``host:port`` of a loopback socket that accepts connections."""
    with socket.socket() as server:
        server.bind(("127.0.0.1", 0))
        server.listen()
        yield f"127.0.0.1:{server.getsockname()[1]}"


NODE_FAULTS = [  # (fault record, check, its parameters, the reason it gives)
    ({"mem_available_bytes": 1}, "memory", host_checks.MemoryParams(),
     "memory available 1B<512MiB"),
    ({"swap_used_bytes": 1 << 51}, "memory", host_checks.MemoryParams(max_swap_used_bytes=1 << 50),
     "swap used 2048TiB"),
    ({"disk_free_bytes": 0, "path": "/"}, "disk", host_checks.DiskParams(paths=("/",),
                                                                         min_free_bytes=1),
     "disk / free 0B<1B"),
    ({"readonly": "/tmp"}, "writable", host_checks.WritableParams(paths=("/tmp",)),
     "/tmp read-only"),
    ({"readonly": "/dev/shm"}, "shm", host_checks.ShmParams(min_free_bytes=1),
     "/dev/shm not writable"),
    ({"missing_mount": "/proc"}, "mounts", host_checks.MountParams(required=("/proc",)),
     "mount /proc missing"),
    ({"link_down": "lo"}, "links", network_checks.LinkParams(interfaces=("lo",)), "lo down"),
]


@pytest.mark.skipif(not os.path.exists("/sys/class/net/lo"), reason="no loopback in sysfs")
@pytest.mark.parametrize("fault, check, params, reason", NODE_FAULTS,
                         ids=[next(iter(f)) for f, *_ in NODE_FAULTS])
def test_a_simulated_node_fault_reaches_its_check(tmp_path, fault, check, params, reason):
    """Through the admin settings, as the hooks and the agent run them: the node's fault
    file changes what the check sees on a simulated node, and only there."""
    simulated = parse_settings({"health": {"backend": "simulated",
                                           "sim_fault_dir": str(tmp_path)}}, "t")
    real = parse_settings({"health": {"backend": "none", "sim_fault_dir": str(tmp_path)}}, "t")
    run = bind(check, params)
    assert run(simulated.context("n1")).status is CheckStatus.PASS   # this host is healthy
    (tmp_path / "n1.json").write_text(json.dumps([fault]))
    result = run(simulated.context("n1"))
    assert (result.status, result.reason) == (CheckStatus.FAIL, reason)
    assert run(simulated.context("n2")).status is CheckStatus.PASS   # another node's file
    assert run(real.context("n1")).status is CheckStatus.PASS        # not a simulated node


def test_simulated_unreachable_peer_and_silent_corruption(tmp_path, listening):
    settings = parse_settings({"health": {"backend": "simulated",
                                          "sim_fault_dir": str(tmp_path)}}, "t")
    peers = bind("peers", network_checks.PeerParams(targets=(listening,)))
    healthy = settings.context("n1")
    assert peers(healthy).status is CheckStatus.PASS and not healthy.host.computes_wrong()
    (tmp_path / "n1.json").write_text(json.dumps([{"unreachable": listening}, {"sdc": True}]))
    faulty = settings.context("n1")
    assert peers(faulty).reason == f"peer {listening} unreachable (simulated)"
    assert faulty.host.computes_wrong()
    (tmp_path / "n1.json").write_text(json.dumps([{"gpu": 0, "sdc": True}]))
    assert settings.context("n1").host.computes_wrong()      # a GPU's corruption: the node's


def test_xid_kernel_records():
    event = xid.parse_kmsg_record("4,99,5000000,-;NVRM: Xid (PCI:0000:3b:00): 79, pid=1, "
                                  "GPU has fallen off the bus.")
    assert (event.pci_bus_id, event.xid, event.uptime_s) == ("0000:3b:00", 79, 5.0)
    assert xid.parse_kmsg_record("6,1,1,-;eth0: link up") is None
    assert xid.normalise_bus_id("00000000:3B:00.0") == "0000:3b:00"
    old, new = (xid.XidEvent("0000:3b:00", 79, t, "") for t in (10.0, 95.0))
    assert xid.recent([old, new], now_uptime_s=100.0, window_s=30) == [new]
    assert xid.recent([old, new], now_uptime_s=100.0, window_s=0) == [old, new]
    assert xid.read_kernel_xids("/nonexistent/kmsg") == []
