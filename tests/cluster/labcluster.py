"""A real multi-node Slurm cluster on one machine, for tests and the demo.

One network namespace per host: ``ftl-ctl`` holds a bridge and runs slurmctld
(the "login node"); each compute node ``nK`` has its own namespace (and UTS
namespace, so ``hostname`` is the node name), a veth into the bridge, an address
of its own and one ``slurmd -N nK``. One munged with its own key and socket
serves them all (a path-named unix socket crosses network namespaces).

The root namespace gets no address in the cluster's subnet, only a blackhole
route for it, so no test traffic can leave the machine.

Everything lives in one state directory (``$LAB_CLUSTER_DIR``, default
``<tmp>/ftl-slurm-cluster``); ``down`` stops the daemons it started, by the PIDs
it recorded, ends what still runs in its namespaces, and removes what it made.
Must run as root. Works with Slurm 22.05 (Debian 12) and 24.11 (Debian 13).

``--slurm R`` / ``$LAB_SLURM_RELEASE=R`` instead runs release R (22.05, 24.11,
26.05) from a Debian root, beside the host's cluster, under an identity of its
own (``instance.py``); slurmctld, each slurmd, munged and every client command
then run inside that root (``debroot.py``).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field
from functools import cache
from pathlib import Path

from . import debroot, instance

CONTROLLER = "ftlctl"
HOSTS_BEGIN = "# BEGIN ftl-slurm-cluster"
HOSTS_END = "# END ftl-slurm-cluster"
PACKAGES = ("slurmctld", "slurmd", "slurm-client", "munge")
DEFAULT_NODES = 6
CPUS_PER_NODE = 2


@dataclass
class Hooks:
    """Paths of the Slurm hook programs (empty: not configured)."""

    prolog: str = ""
    epilog: str = ""
    healthcheck: str = ""
    healthcheck_interval: int = 0
    prolog_flags: str = ""


@dataclass
class ClusterState:
    nodes: list[str]
    pids: dict[str, int] = field(default_factory=dict)
    hooks: Hooks = field(default_factory=Hooks)
    release: str = instance.HOST

    @staticmethod
    def load(path: Path) -> ClusterState:
        raw = json.loads(path.read_text())
        return ClusterState(nodes=raw["nodes"], pids=raw["pids"], hooks=Hooks(**raw["hooks"]),
                            release=raw.get("release", instance.HOST))

    def save(self, path: Path) -> None:
        tmp = path.with_suffix(".tmp")
        tmp.write_text(json.dumps(asdict(self), indent=1))
        os.replace(tmp, path)


def state_dir() -> Path:
    return Path(os.environ.get("LAB_CLUSTER_DIR") or instance.current().default_state_dir)


def subnet() -> str:
    return instance.current().subnet


def node_address(index: int) -> str:
    return f"{subnet()}.{10 + index}"


def netns(host: str) -> str:
    return instance.current().netns_prefix + host


def in_root() -> list[str]:
    """The prefix that runs a command inside the release's root ([] on the host)."""
    return [] if instance.current().root is None else [str(state_dir() / "in-root")]


def run(*argv: str, check: bool = True, timeout: float = 60, **kw) -> subprocess.CompletedProcess:
    return subprocess.run(argv, check=check, timeout=timeout, text=True,
                          capture_output=True, **kw)


# --------------------------------------------------------------------------- config


#: Also how long slurmctld waits on a crashed node's slurmd before it gives up on it.
MESSAGE_TIMEOUT = 5


def slurm_release() -> str:
    """The cluster's Slurm as ``24.11``: a release's root holds that release (checked
    when it was built); the host's is whatever its slurmctld says."""
    release = instance.current().release
    return _host_release() if release == instance.HOST else release


@cache
def _host_release() -> str:
    return ".".join(run("slurmctld", "-V").stdout.split()[-1].split(".")[:2])


def slurmd_timeout(release: str) -> int:
    """SlurmdTimeout: short, so a dead node is DOWN soon (5 s: in ~17 s), as long as
    no live node can look silent for that long.

    Up to 22.05 slurmctld pings each node with a message of its own. From 24.11 one
    ping (and each periodic registration request, which goes to DOWN nodes too)
    goes to all nodes at once, and no node's reply counts before the slowest is in:
    with a crashed node in it, MessageTimeout + ~2 s. A live node is pinged once its
    last reply is SlurmdTimeout/3 old, a check for SlurmdTimeout can run before the
    previous round's replies are counted, and so under 5 s every live node was set
    DOWN (its jobs requeued) seconds after a crash (tests/cluster/README.md). A
    SlurmdTimeout above three such rounds is safe: six MessageTimeouts."""
    major, minor = (int(part) for part in release.split("."))
    return 5 if (major, minor) < (24, 11) else 6 * MESSAGE_TIMEOUT


def slurm_conf(base: Path, nodes: list[str], hooks: Hooks) -> str:
    """slurm.conf for the lab cluster (choices explained in shared/docs/slurm-lab.md)."""
    lines = [
        "ClusterName=ftl",
        f"SlurmctldHost={CONTROLLER}({subnet()}.1)",
        "SlurmUser=root",
        "SlurmdUser=root",
        # cred_expire: a requeued job may start again only after it (120 s by default);
        # the tests of the requeue path (batch host lost) need it short.
        f"AuthInfo=socket={base}/munge/munge.socket,cred_expire=10",
        f"StateSaveLocation={base}/state",
        f"SlurmdSpoolDir={base}/spool/slurmd-%n",
        f"SlurmctldPidFile={base}/run/slurmctld.pid",
        f"SlurmdPidFile={base}/run/slurmd-%n.pid",
        f"SlurmctldLogFile={base}/log/slurmctld.log",
        f"SlurmdLogFile={base}/log/slurmd-%n.log",
        "SlurmctldPort=6817",
        "SlurmdPort=6818",
        "SlurmdParameters=config_overrides",
        "ProctrackType=proctrack/linuxproc",
        # task/cgroup would pin every node's task 0 to CPU 0: all nodes share the cores.
        "TaskPlugin=task/none",
        "JobAcctGatherType=jobacct_gather/none",
        "AccountingStorageType=accounting_storage/none",
        "SelectType=select/cons_tres",
        "SelectTypeParameters=CR_CPU",
        "SchedulerParameters=bf_interval=5,permit_job_expansion",
        "ReturnToService=2",
        "MpiDefault=none",
        "MailProg=/bin/true",
        f"SlurmdTimeout={slurmd_timeout(slurm_release())}",
        f"MessageTimeout={MESSAGE_TIMEOUT}",
        # Every slurmd answers slurmctld directly. From 24.11 the pings go through a
        # tree of slurmds even on 6 nodes (default width 16), and one dead forwarder
        # had every node it forwarded to set DOWN and removed from the job.
        "TreeWidth=65533",
        "InactiveLimit=0",
        "KillWait=2",
        # A step's slurmstepd reports its end to slurmctld, retrying while slurmctld is
        # busy; on a loaded lab host the retries outlasted the 60 s default, and Slurm
        # drained a healthy node "Kill task failed" (a moved standby, in CI on 24.11).
        "UnkillableStepTimeout=180",
        "MinJobAge=600",
        "SlurmctldDebug=info",
        "SlurmdDebug=info",
    ]
    if hooks.prolog:
        lines.append(f"Prolog={hooks.prolog}")
    if hooks.epilog:
        lines.append(f"Epilog={hooks.epilog}")
    if hooks.prolog_flags:
        lines.append(f"PrologFlags={hooks.prolog_flags}")
    if hooks.healthcheck:
        lines.append(f"HealthCheckProgram={hooks.healthcheck}")
        lines.append(f"HealthCheckInterval={hooks.healthcheck_interval or 60}")
        lines.append("HealthCheckNodeState=ANY")
    for index, node in enumerate(nodes, start=1):
        lines.append(f"NodeName={node} NodeAddr={node_address(index)} NodeHostname={node} "
                     f"CPUs={CPUS_PER_NODE} RealMemory=1000 State=UNKNOWN")
    lines.append(f"PartitionName=main Nodes={','.join(nodes)} Default=YES "
                 "MaxTime=INFINITE State=UP OverSubscribe=NO")
    return "\n".join(lines) + "\n"


def client_env(base: Path | None = None) -> dict[str, str]:
    """Environment for Slurm client commands aimed at this cluster."""
    base = base or state_dir()
    env = dict(os.environ)
    env["SLURM_CONF"] = str(base / "slurm.conf")
    return env


# --------------------------------------------------------------------------- bring-up


def ensure_packages() -> None:
    if instance.current().root is not None:
        try:
            _, how = debroot.ensure_root(instance.current().release)
        except debroot.RootError as error:
            raise SystemExit(f"slurm-cluster: cannot bring up {instance.current().label}: "
                             f"{error}") from None
        print(f"{instance.current().label}: root {how}", file=sys.stderr)
        return
    if shutil.which("slurmctld") and shutil.which("munged") and shutil.which("sbatch"):
        return
    env = dict(os.environ, DEBIAN_FRONTEND="noninteractive")
    subprocess.run(["apt-get", "update", "-qq"], check=True, env=env, timeout=600)
    subprocess.run(["apt-get", "install", "-y", "-qq", *PACKAGES], check=True, env=env,
                   timeout=900)


def make_network(nodes: list[str]) -> None:
    ctl, bridge, net = netns(CONTROLLER), instance.current().bridge, subnet()
    run("ip", "netns", "add", ctl)
    run("ip", "-n", ctl, "link", "set", "lo", "up")
    run("ip", "-n", ctl, "link", "add", bridge, "type", "bridge")
    run("ip", "-n", ctl, "addr", "add", f"{net}.1/24", "dev", bridge)
    run("ip", "-n", ctl, "link", "set", bridge, "up")
    for index, node in enumerate(nodes, start=1):
        ns = netns(node)
        run("ip", "netns", "add", ns)
        run("ip", "-n", ns, "link", "set", "lo", "up")
        peer = f"ftlv{index}"
        run("ip", "-n", ctl, "link", "add", peer, "type", "veth", "peer", "name", "eth0",
            "netns", ns)
        run("ip", "-n", ctl, "link", "set", peer, "master", bridge)
        run("ip", "-n", ctl, "link", "set", peer, "up")
        run("ip", "-n", ns, "addr", "add", f"{node_address(index)}/24", "dev", "eth0")
        run("ip", "-n", ns, "link", "set", "eth0", "up")
    # Nothing in the root namespace may reach the lab subnet (no traffic leaves).
    run("ip", "route", "replace", "blackhole", f"{net}.0/24", check=False)


def write_hosts(nodes: list[str]) -> None:
    entries = [f"{subnet()}.1 {CONTROLLER}"]
    entries += [f"{node_address(i)} {n}" for i, n in enumerate(nodes, start=1)]
    root = instance.current().root
    if root is not None:   # the release's own /etc/hosts: the host's stays as it is
        debroot.write_hosts(root, entries)
        return
    remove_hosts()
    with open("/etc/hosts", "a", encoding="utf-8") as hosts:
        hosts.write("\n".join([HOSTS_BEGIN, *entries, HOSTS_END]) + "\n")


def remove_hosts() -> None:
    path = Path("/etc/hosts")
    kept, inside = [], False
    for line in path.read_text().splitlines():
        if line == HOSTS_BEGIN:
            inside = True
        elif line == HOSTS_END:
            inside = False
        elif not inside:
            kept.append(line)
    # /etc/hosts may be a bind mount: rewrite in place rather than rename over it.
    path.write_text("\n".join(kept) + "\n")


def start_in_namespace(host: str, argv: list[str], log: Path) -> int:
    """Start a daemon in ``host``'s network + its own UTS namespace; return its PID."""
    script = f'hostname {host} && exec "$@"'
    argv = [*in_root(), *argv]
    with log.open("ab") as out:
        proc = subprocess.Popen(
            ["nsenter", f"--net=/run/netns/{netns(host)}", "unshare", "--uts",
             "sh", "-c", script, "sh", *argv],
            stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
            start_new_session=True)
    return proc.pid


def start_munge(base: Path) -> int:
    munge = base / "munge"
    munge.mkdir(mode=0o711, exist_ok=True)
    os.chmod(munge, 0o711)  # the socket's directory must be world-executable
    key = munge / "munge.key"
    if not key.exists():
        key.write_bytes(os.urandom(1024))
        os.chmod(key, 0o400)
    log = base / "log" / "munged.log"
    subprocess.run([*in_root(), "munged", "--force", f"--socket={munge}/munge.socket",
                    f"--key-file={key}", f"--pid-file={munge}/munged.pid",
                    f"--log-file={log}", f"--seed-file={munge}/munged.seed"],
                   check=True, timeout=30, capture_output=True)
    return int((munge / "munged.pid").read_text().split()[0])


def up(nodes_count: int = DEFAULT_NODES, hooks: Hooks | None = None,
       ready_timeout: float = 60) -> ClusterState:
    """Bring the cluster up (idempotent: a running cluster is left as it is)."""
    base = state_dir()
    existing = current_state()
    if existing is not None and all(pid_alive(p) for p in existing.pids.values()):
        return existing
    if existing is not None:
        down()
    ensure_packages()
    nodes = [f"n{i}" for i in range(1, nodes_count + 1)]
    state = ClusterState(nodes=nodes, hooks=hooks or Hooks(),
                         release=instance.current().release)
    for sub in ("state", "spool", "run", "log"):
        (base / sub).mkdir(parents=True, exist_ok=True)
    (base / "slurm.conf").write_text(slurm_conf(base, nodes, state.hooks))
    state.save(base / "cluster.json")  # before anything starts, so down() can clean up
    root = instance.current().root
    if root is not None:
        debroot.mount_shared(root)
        debroot.write_enter_script(root, base / "in-root")
    make_network(nodes)
    write_hosts(nodes)
    state.pids["munged"] = start_munge(base)
    conf = str(base / "slurm.conf")
    state.pids["slurmctld"] = start_in_namespace(
        CONTROLLER, ["slurmctld", "-D", "-i", "-f", conf], base / "log" / "slurmctld.out")
    state.save(base / "cluster.json")
    for node in nodes:
        state.pids[node] = start_in_namespace(
            node, ["slurmd", "-D", "-N", node, "-f", conf], base / "log" / f"slurmd-{node}.out")
        state.save(base / "cluster.json")
    wait_idle(nodes, ready_timeout)
    return state


def wait_idle(nodes: list[str], timeout: float) -> None:
    deadline = time.monotonic() + timeout
    last = ""
    while time.monotonic() < deadline:
        res = ctl_run(["sinfo", "-h", "-N", "-o", "%N %t"], check=False, timeout=10)
        states = dict(line.split() for line in res.stdout.splitlines() if line.strip())
        if all(states.get(n) in ("idle", "alloc", "mix") for n in nodes):
            return
        last = res.stdout + res.stderr
        time.sleep(0.2)  # polling a daemon's state with a deadline, not synchronisation
    raise TimeoutError(f"Slurm nodes not idle after {timeout} s: {last.strip()}")


def ctl_prefix() -> list[str]:
    """Command prefix that runs a program on the login node (the controller namespace)."""
    return ["nsenter", f"--net=/run/netns/{netns(CONTROLLER)}", *in_root()]


def ctl_run(argv: list[str], *, check: bool = True, timeout: float = 60,
            **kw) -> subprocess.CompletedProcess:
    """Run a command on the login node (the controller's namespace)."""
    return subprocess.run([*ctl_prefix(), *argv], check=check, timeout=timeout, text=True, capture_output=True,
                          env=kw.pop("env", client_env()), **kw)


def configure(hooks: Hooks) -> ClusterState:
    """Point the running cluster at new hook programs (``scontrol reconfigure``)."""
    state = require_state()
    state.hooks = hooks
    base = state_dir()
    (base / "slurm.conf").write_text(slurm_conf(base, state.nodes, hooks))
    state.save(base / "cluster.json")
    ctl_run(["scontrol", "reconfigure"], timeout=30)
    return state


# --------------------------------------------------------------------------- faults


def kill_node(node: str) -> list[int]:
    """Crash a whole node: every process in its network namespace stops at once, then
    dies. Stopped first (SIGSTOP) so that none of them sees another die and acts on it
    (a controller reaping its dead srun clients would cancel their steps), as no process
    can when a real node loses power. Killed children first: a parent dying before its
    stopped children would orphan their process group, and the kernel wakes such a group
    with SIGHUP and SIGCONT (an srun client woken so cancels its step)."""
    pids: list[int] = []
    while fresh := [pid for pid in namespace_pids(node) if pid not in pids]:
        for pid in fresh:            # again for any forked while the first were stopped
            _signal(pid, signal.SIGSTOP)
        pids += fresh
    depth = _tree_depths(pids)
    for pid in sorted(pids, key=lambda p: -depth[p]):
        _signal(pid, signal.SIGKILL)
    return pids


def _tree_depths(pids: list[int]) -> dict[int, int]:
    """Each process's depth below the others of ``pids`` (0: its parent is not one)."""
    parents = {pid: _parent(pid) for pid in pids}

    def depth(pid: int) -> int:
        levels = 0
        while (pid := parents.get(pid, 0)) in parents and levels < len(parents):
            levels += 1
        return levels

    return {pid: depth(pid) for pid in pids}


def _parent(pid: int) -> int:
    try:   # the command may hold spaces or parentheses: the fields after its last ")"
        return int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1])
    except (FileNotFoundError, IndexError, ValueError):
        return 0


def _signal(pid: int, signum: int) -> None:
    try:
        os.kill(pid, signum)
    except ProcessLookupError:
        pass


@contextmanager
def throttle_node(node: str, marker: bytes = b"train.py", stopped: float = 0.25,
                  running: float = 0.05) -> Iterator[None]:
    """A fail-slow node while the block runs: its processes whose command line holds
    ``marker`` run ``running`` s of every ``stopped + running`` (SIGSTOP/SIGCONT bursts,
    as on a node whose CPUs are throttled or oversubscribed); never stopped for long
    enough to miss a quorum heartbeat window. Every one is running again afterwards."""
    done = threading.Event()

    def targets() -> list[int]:
        pids = []
        for pid in namespace_pids(node):
            try:
                if marker in Path(f"/proc/{pid}/cmdline").read_bytes():
                    pids.append(pid)
            except OSError:
                continue                 # exited meanwhile
        return pids

    def bursts() -> None:
        while not done.is_set():
            pids = targets()
            for pid in pids:
                _signal(pid, signal.SIGSTOP)
            done.wait(stopped)           # the throttle's duty cycle, not a synchronisation
            for pid in pids:
                _signal(pid, signal.SIGCONT)
            done.wait(running)

    thread = threading.Thread(target=bursts, name=f"throttle-{node}", daemon=True)
    thread.start()
    try:
        yield
    finally:
        done.set()
        thread.join()


def revive_node(node: str) -> int:
    state = require_state()
    base = state_dir()
    pid = start_in_namespace(node, ["slurmd", "-D", "-N", node, "-f", str(base / "slurm.conf")],
                             base / "log" / f"slurmd-{node}.out")
    state.pids[node] = pid
    state.save(base / "cluster.json")
    return pid


def heal_node(node: str, timeout: float = 90) -> None:
    """Undo a fault test: restart the node's slurmd if it is dead, reconnect it, clear
    DOWN / DRAIN once it responds, and wait until Slurm can use it again."""
    state = require_state()
    if not pid_alive(state.pids.get(node, -1)):
        revive_node(node)
    set_link(node, True)
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        line = ctl_run(["sinfo", "-h", "-n", node, "-o", "%t"], check=False).stdout.strip()
        if line in ("idle", "mix", "alloc"):
            return
        if line and not line.endswith("*"):  # responding, but down or drained by a test
            ctl_run(["scontrol", "update", f"nodename={node}", "state=resume"], check=False)
        time.sleep(0.5)  # polling the controller's view of the node, with a deadline
    raise TimeoutError(f"node {node} not back in service after {timeout} s")


def set_link(node: str, is_up: bool) -> None:
    """Partition a node from the network (link down) or heal it."""
    run("ip", "-n", netns(node), "link", "set", "eth0", "up" if is_up else "down")


@contextmanager
def partition_node(node: str) -> Iterator[None]:
    """``node`` cut off the network while the block runs: its link is down inside its
    namespace, so no packet goes in or out while its processes run on (and still share
    the machine's files, as nodes share a parallel file system). Healed afterwards,
    even when the block fails."""
    set_link(node, False)
    try:
        yield
    finally:
        set_link(node, True)


# --------------------------------------------------------------------------- teardown


def namespace_pids(host: str) -> list[int]:
    res = run("ip", "netns", "pids", netns(host), check=False)
    return [int(p) for p in res.stdout.split()]


def pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    try:
        return Path(f"/proc/{pid}/stat").read_text().split()[2] != "Z"
    except FileNotFoundError:  # exited between the two looks
        return False


def current_state() -> ClusterState | None:
    path = state_dir() / "cluster.json"
    return ClusterState.load(path) if path.exists() else None


def require_state() -> ClusterState:
    state = current_state()
    if state is None:
        raise SystemExit(f"no cluster in {state_dir()}: run 'slurm-cluster up' first")
    return state


def down(keep_logs: bool = False) -> None:
    state = current_state()
    base = state_dir()
    if state is None:
        return
    hosts = [CONTROLLER, *state.nodes]
    # Everything in our namespaces was started by this cluster (daemons, job tasks).
    victims = set(state.pids.values())
    for host in hosts:
        victims.update(namespace_pids(host))
    for pid in victims:
        try:
            os.kill(pid, signal.SIGTERM)
        except ProcessLookupError:
            pass
    deadline = time.monotonic() + 5
    while time.monotonic() < deadline and any(pid_alive(p) for p in victims):
        time.sleep(0.05)
    for pid in victims:
        if pid_alive(pid):
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
    for host in hosts:
        run("ip", "netns", "del", netns(host), check=False)
    run("ip", "route", "del", "blackhole", f"{subnet()}.0/24", check=False)
    root = instance.current().root
    if root is None:
        remove_hosts()
    else:   # nothing may stay mounted in the cached root
        debroot.unmount_all(root)
    if keep_logs:
        (base / "cluster.json").unlink(missing_ok=True)
    else:
        shutil.rmtree(base, ignore_errors=True)


def status() -> str:
    state = current_state()
    if state is None:
        return f"down (no cluster in {state_dir()})"
    lines = [f"{instance.current().label}; state dir: {state_dir()}",
             f"SLURM_CONF={state_dir() / 'slurm.conf'}"]
    for name, pid in state.pids.items():
        lines.append(f"{name:10s} pid {pid:7d} {'running' if pid_alive(pid) else 'DEAD'}")
    res = ctl_run(["sinfo", "-N", "-o", "%N %t %E"], check=False, timeout=15)
    lines.append(res.stdout.rstrip() or res.stderr.rstrip())
    return "\n".join(lines)


# --------------------------------------------------------------------------- CLI


def env_line() -> str:
    line = f"export SLURM_CONF={state_dir() / 'slurm.conf'}"
    if instance.current().root is not None:   # tests find the cluster by this
        line += f" LAB_SLURM_RELEASE={instance.current().release}"
    return line


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="slurm-cluster",
        description="Bring a multi-node Slurm cluster up on this machine (one network "
                    "namespace per node), or down. Run as root.")
    which = argparse.ArgumentParser(add_help=False)
    which.add_argument("--slurm", metavar="RELEASE", default=instance.release_requested(),
                       choices=[instance.HOST, *debroot.SUITES],
                       help="which cluster: the host's Slurm (default; $LAB_SLURM_RELEASE) "
                            "or a release run from a Debian root beside it")
    sub = parser.add_subparsers(dest="command", required=True)
    p_up = sub.add_parser("up", parents=[which],
                          help="install Slurm+munge if missing, start ctld + N slurmd")
    p_up.add_argument("--nodes", type=int, default=DEFAULT_NODES)
    p_down = sub.add_parser("down", parents=[which],
                            help="stop every daemon and remove namespaces and files")
    p_down.add_argument("--keep-logs", action="store_true")
    sub.add_parser("status", parents=[which], help="daemons and node states")
    sub.add_parser("env", parents=[which], help="print the export line for Slurm clients")
    p_exec = sub.add_parser("exec", parents=[which],
                            help="run a command on the login node (controller netns)")
    p_exec.add_argument("argv", nargs=argparse.REMAINDER)
    p_conf = sub.add_parser("configure", parents=[which],
                            help="set Prolog/Epilog/HealthCheckProgram")
    for hook in ("prolog", "epilog", "healthcheck", "prolog-flags"):
        p_conf.add_argument(f"--{hook}", default="")
    p_conf.add_argument("--healthcheck-interval", type=int, default=0)
    for verb in ("kill-node", "revive-node", "heal-node", "partition", "heal"):
        sub.add_parser(verb, parents=[which]).add_argument("node")
    args = parser.parse_args(argv)
    if os.geteuid() != 0:
        parser.error("must run as root (network namespaces, daemons)")
    os.environ["LAB_SLURM_RELEASE"] = args.slurm   # every helper below reads it
    if args.command == "up":
        started = time.monotonic()
        try:
            state = up(args.nodes)
        except (debroot.RootError, subprocess.SubprocessError, OSError, TimeoutError) as error:
            detail = getattr(error, "stderr", None) or ""
            raise SystemExit(f"slurm-cluster: bring-up of {instance.current().label} failed: "
                             f"{error} {detail}".rstrip() + f"\n  logs: {state_dir() / 'log'}; "
                             f"clean up: slurm-cluster down --slurm {args.slurm}") from None
        print(f"up: {instance.current().label}, {len(state.nodes)} nodes "
              f"{','.join(state.nodes)} in {time.monotonic() - started:.1f} s; "
              f"{env_line()}")
    elif args.command == "down":
        down(args.keep_logs)
    elif args.command == "status":
        print(status())
    elif args.command == "env":
        print(env_line())
    elif args.command == "exec":
        cmd = args.argv[1:] if args.argv[:1] == ["--"] else args.argv
        return subprocess.call([*ctl_prefix(), *cmd], env=client_env())
    elif args.command == "configure":
        configure(Hooks(args.prolog, args.epilog, args.healthcheck,
                        args.healthcheck_interval, args.prolog_flags))
    elif args.command == "kill-node":
        print(" ".join(map(str, kill_node(args.node))))
    elif args.command == "revive-node":
        print(revive_node(args.node))
    elif args.command == "heal-node":
        heal_node(args.node)
    elif args.command in ("partition", "heal"):
        set_link(args.node, args.command == "heal")
    return 0


if __name__ == "__main__":
    sys.exit(main())
