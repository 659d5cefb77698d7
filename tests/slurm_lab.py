"""A real Slurm cluster on this machine for the multi-host tests: each host a network namespace with its own
address, hostname and slurmd; slurmctld and munged in the root namespace. Needs root and Debian's
``slurmctld slurmd slurm-client munge`` (``.ci/run`` installs them).

Each host has its own disk at one path, ``Lab.node_local``: every slurmd (and so every job step) runs in a
mount namespace of its own where that path is its host's directory under ``disks/``, as node-local NVMe is
on real hosts; this machine (the login node) sees its own, empty one there. ``wipe_disk`` loses a host's.
Each host has its own memory too: a tmpfs of its own on ``/dev/shm`` in that mount namespace, gone when
every process of the host is (``kill_host``), new when it comes back.

Every packet for the lab's addresses stays on the machine: an ``unreachable`` route for the lab's /16 is
added before the bridge exists and removed after it is gone, and no namespace has a default route.

    python -m tests.slurm_lab up 3      # prints the lab's directory and its SLURM_CONF
    python -m tests.slurm_lab down      # tears down every lab this machine holds (stale ones too)
"""

from __future__ import annotations

import contextlib
import json
import os
import random
import shutil
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

MEMORY_SIZE = "1g"  # each host's /dev/shm (tmpfs: pages used, not reserved)
LABS = Path("/tmp/rewind-slurm-labs")  # one JSON per lab: what teardown needs, even after a crash
PACKAGES = ("slurmctld", "slurmd", "srun", "munged", "mungekey", "ip", "nsenter", "unshare")


def unavailable() -> str | None:
    """Why a lab cannot be made here (one line), or None."""
    if os.geteuid() != 0:
        return "the Slurm lab needs root (network namespaces, a bridge, slurmd)"
    missing = [p for p in PACKAGES if shutil.which(p) is None]
    if missing:
        return (
            f"the Slurm lab needs {', '.join(missing)} (apt-get install slurmctld slurmd slurm-client munge)"
        )
    return None


def _sh(*cmd: str, check: bool = True, timeout: float = 30) -> subprocess.CompletedProcess[str]:
    return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, check=check)


@dataclass
class Host:
    name: str
    address: str
    netns: str
    veth: str  # the root-namespace end, in the bridge
    pid: int = 0  # slurmd's (the unshare wrapper that execs it)


@dataclass
class Lab:
    """One cluster: ``up()``, use ``env`` for every Slurm client, ``down()`` whatever happened."""

    hosts: int = 3
    lab_id: str = field(default_factory=lambda: f"{random.randrange(16**4):04x}")
    root: Path = Path()
    subnet: str = ""
    members: list[Host] = field(default_factory=list)
    pids: dict[str, int] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.root = Path(f"/tmp/rewind-slurm-{self.lab_id}")
        self.subnet = f"10.{200 + int(self.lab_id, 16) % 50}"
        self.bridge = f"rwb{self.lab_id}"
        self.controller = f"rw{self.lab_id}c"
        self.members = [
            Host(
                f"rw{self.lab_id}h{i}",
                f"{self.subnet}.0.{10 + i}",
                f"rw{self.lab_id}h{i}",
                f"rw{self.lab_id}v{i}",
            )
            for i in range(1, self.hosts + 1)
        ]

    @property
    def conf(self) -> Path:
        return self.root / "slurm.conf"

    @property
    def node_local(self) -> Path:
        """The path of every host's own disk (each host sees its own directory there)."""
        return self.root / "node-local"

    def disk(self, name: str) -> Path:
        """Host ``name``'s own disk, as this machine reaches it."""
        return self.root / "disks" / name

    def wipe_disk(self, name: str) -> None:
        """Host ``name``'s disk gone (emptied: a new disk when the host comes back)."""
        shutil.rmtree(self.disk(name))
        self.disk(name).mkdir()

    @property
    def env(self) -> dict[str, str]:
        """What a Slurm client (srun, salloc, scontrol) needs to talk to this cluster."""
        return {"SLURM_CONF": str(self.conf)}

    def host(self, name: str) -> Host:
        return next(h for h in self.members if h.name == name)

    # -- up ----------------------------------------------------------------------------

    def up(self, timeout_s: float = 60) -> Lab:
        teardown_stale()
        self.root.mkdir(parents=True)
        self._record()
        try:
            self._network()
            self._files()
            self._munge()
            self._controller()
            for h in self.members:
                self._slurmd(h)
            self.wait_idle(timeout_s=timeout_s)
        except BaseException:
            self.down()
            raise
        return self

    def _record(self) -> None:
        LABS.mkdir(exist_ok=True)
        (LABS / f"{self.lab_id}.json").write_text(json.dumps({"owner": os.getpid(), "hosts": self.hosts}))

    def _network(self) -> None:
        _sh("ip", "route", "replace", "unreachable", f"{self.subnet}.0.0/16", "metric", "4000")
        _sh("ip", "link", "add", self.bridge, "type", "bridge")
        _sh("ip", "addr", "add", f"{self.subnet}.0.1/24", "dev", self.bridge)
        _sh("ip", "link", "set", self.bridge, "up")
        for h in self.members:
            _sh("ip", "netns", "add", h.netns)
            _sh("ip", "link", "add", h.veth, "type", "veth", "peer", "name", f"{h.veth}p")
            _sh("ip", "link", "set", f"{h.veth}p", "netns", h.netns)
            _sh("ip", "link", "set", h.veth, "master", self.bridge, "up")
            _sh("ip", "-n", h.netns, "addr", "add", f"{h.address}/24", "dev", f"{h.veth}p")
            _sh("ip", "-n", h.netns, "link", "set", f"{h.veth}p", "up")
            _sh("ip", "-n", h.netns, "link", "set", "lo", "up")

    def _files(self) -> None:
        names = [f"{self.subnet}.0.1 {self.controller}"] + [f"{h.address} {h.name}" for h in self.members]
        (self.root / "hosts").write_text("127.0.0.1 localhost\n" + "\n".join(names) + "\n")
        for d in ("munge", "spool", "state", "log", "node-local"):
            (self.root / d).mkdir()
        for h in self.members:
            self.disk(h.name).mkdir(parents=True)
        (self.root / "munge").chmod(0o755)  # munged refuses a socket directory without world-execute
        nodes = "\n".join(
            f"NodeName={h.name} NodeAddr={h.address} NodeHostname={h.name} CPUs=2 State=UNKNOWN"
            for h in self.members
        )
        self.conf.write_text(
            _CONF.format(
                controller=self.controller, address=f"{self.subnet}.0.1", root=self.root, nodes=nodes,
                all=",".join(h.name for h in self.members),
            )
        )  # fmt: skip

    def _munge(self) -> None:
        key = self.root / "munge" / "munge.key"
        _sh("mungekey", "-c", "-k", str(key))
        key.chmod(0o400)
        m = self.root / "munge"
        self._daemon(
            "munged",
            ["munged", "-F", "-f", f"--socket={m / 'munge.socket.2'}", f"--key-file={key}",
             f"--pid-file={m / 'munged.pid'}", f"--log-file={self.root / 'log' / 'munged.log'}",
             f"--seed-file={m / 'munged.seed'}"],
        )  # fmt: skip
        _wait(lambda: (m / "munge.socket.2").exists(), 10, "munged's socket")

    def _controller(self) -> None:
        self._daemon(
            "slurmctld",
            [
                "unshare",
                "--uts",
                "sh",
                "-c",
                f"hostname {self.controller} && exec slurmctld -D -i -f {self.conf}",
            ],
        )

    def _slurmd(self, h: Host) -> None:
        script = (
            f"hostname {h.name} && mount --bind {self.root / 'hosts'} /etc/hosts"
            f" && mount --bind {self.disk(h.name)} {self.node_local}"
            f" && mount -t tmpfs -o size={MEMORY_SIZE},mode=1777 tmpfs /dev/shm"  # its own memory: gone with it
            f" && exec slurmd -D -N {h.name} -f {self.conf}"
        )
        h.pid = self._daemon(
            f"slurmd-{h.name}",
            ["nsenter", f"--net=/run/netns/{h.netns}", "unshare", "--uts", "--mount", "--propagation", "private",
             "sh", "-c", script],
        )  # fmt: skip

    def _daemon(self, name: str, cmd: list[str]) -> int:
        log = open(self.root / "log" / f"{name}.out", "ab")  # noqa: SIM115 (the daemon keeps it)
        proc = subprocess.Popen(
            cmd, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, start_new_session=True,
            env={**os.environ, **self.env},
        )  # fmt: skip
        log.close()
        self.pids[name] = proc.pid
        return proc.pid

    # -- state -------------------------------------------------------------------------

    def states(self) -> dict[str, str]:
        """Each node's state as Slurm reports it (``idle``, ``allocated``, ``down*``...)."""
        out = subprocess.run(
            ["sinfo", "-N", "-h", "-o", "%N %t"], capture_output=True, text=True, timeout=15,
            env={**os.environ, **self.env}, check=False,
        ).stdout  # fmt: skip
        return dict(line.split() for line in out.splitlines() if len(line.split()) == 2)

    def wait_idle(self, names: list[str] | None = None, timeout_s: float = 60) -> None:
        want = names or [h.name for h in self.members]
        _wait(lambda: all(self.states().get(n) == "idle" for n in want), timeout_s, f"nodes {want} idle")

    # -- faults ------------------------------------------------------------------------

    def kill_host(self, name: str) -> None:
        """Every process of the host SIGKILLed, slurmd included: the machine is gone."""
        h = self.host(name)
        for pid in self.netns_pids(h):
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)

    def revive_host(self, name: str, timeout_s: float = 60) -> None:
        """The host back (a new slurmd; its namespace kept): idle again once Slurm has it."""
        h = self.host(name)
        self.kill_host(name)
        _wait(lambda: not self.netns_pids(h), 10, f"every process of {name} gone")
        self._slurmd(h)
        self.wait_idle([name], timeout_s=timeout_s)

    def cut_link(self, name: str) -> None:
        """The host's network gone (its link down); its processes keep running: a real partition."""
        _sh("ip", "-n", self.host(name).netns, "link", "set", f"{self.host(name).veth}p", "down")

    def restore_link(self, name: str) -> None:
        _sh("ip", "-n", self.host(name).netns, "link", "set", f"{self.host(name).veth}p", "up")

    def netns_pids(self, h: Host) -> list[int]:
        out = _sh("ip", "netns", "pids", h.netns, check=False).stdout
        return [int(p) for p in out.split()]

    # -- down --------------------------------------------------------------------------

    def down(self) -> None:
        teardown(self.lab_id, self.hosts)


def teardown(lab_id: str, hosts: int) -> None:
    """Remove a lab entirely, whatever state it is in: processes, namespaces, links, route, files."""
    lab = Lab.__new__(Lab)
    lab.hosts, lab.lab_id, lab.pids = hosts, lab_id, {}
    Lab.__post_init__(lab)
    for h in lab.members:  # links up first, so that no process is left retrying a cut-off peer
        _sh("ip", "-n", h.netns, "link", "set", f"{h.veth}p", "up", check=False)
    for pid in _processes_with_conf(lab.conf):
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
    for h in lab.members:
        for pid in lab.netns_pids(h):
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        _sh("ip", "netns", "delete", h.netns, check=False)
        _sh("ip", "link", "delete", h.veth, check=False)
    _sh("ip", "link", "delete", lab.bridge, check=False)
    _sh("ip", "route", "del", "unreachable", f"{lab.subnet}.0.0/16", "metric", "4000", check=False)
    shutil.rmtree(lab.root, ignore_errors=True)
    (LABS / f"{lab_id}.json").unlink(missing_ok=True)


def _processes_with_conf(conf: Path) -> list[int]:
    """Every process started for this lab (daemons and clients carry its SLURM_CONF, or name it)."""
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or int(entry.name) == os.getpid():
            continue
        try:
            env = (entry / "environ").read_bytes()
            cmdline = (entry / "cmdline").read_bytes()
        except OSError:
            continue
        if f"SLURM_CONF={conf}".encode() in env.split(b"\0") or str(conf).encode() in cmdline:
            found.append(int(entry.name))
    return found


def teardown_stale() -> None:
    """Labs left by a process that is gone (a killed test session)."""
    for record in LABS.glob("*.json") if LABS.exists() else ():
        info = json.loads(record.read_text())
        if not Path(f"/proc/{info['owner']}").exists():
            teardown(record.stem, int(info["hosts"]))


def _wait(ok: object, timeout_s: float, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    while not ok():  # type: ignore[operator]
        if time.monotonic() > deadline:
            raise TimeoutError(f"Slurm lab: {what} not reached in {timeout_s:.0f} s")
        time.sleep(0.1)


_CONF = """\
ClusterName=rewind
SlurmctldHost={controller}({address})
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
CredType=cred/munge
AuthInfo=socket={root}/munge/munge.socket.2
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
JobCompType=jobcomp/filetxt
JobCompLoc={root}/log/jobcomp.txt
MpiDefault=none
SwitchType=switch/none
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
ReturnToService=2
SlurmdTimeout=10
SlurmctldTimeout=10
MessageTimeout=5
KillWait=5
InactiveLimit=0
MinJobAge=300
MailProg=/bin/true
StateSaveLocation={root}/state
SlurmdSpoolDir={root}/spool/%n
SlurmctldPidFile={root}/state/slurmctld.pid
SlurmdPidFile={root}/spool/slurmd-%n.pid
SlurmctldLogFile={root}/log/slurmctld.log
SlurmdLogFile={root}/log/slurmd-%n.log
SlurmctldPort=6817
SlurmdPort=6818
{nodes}
PartitionName=main Nodes={all} Default=YES MaxTime=INFINITE State=UP
"""


def main(argv: list[str]) -> int:
    if argv[:1] == ["up"]:
        lab = Lab(hosts=int(argv[1]) if len(argv) > 1 else 3).up()
        print(f"lab {lab.lab_id} in {lab.root}: export SLURM_CONF={lab.conf}")
        (LABS / f"{lab.lab_id}.json").write_text(json.dumps({"owner": 1, "hosts": lab.hosts}))  # outlives us
        return 0
    if argv[:1] == ["down"]:
        for record in LABS.glob("*.json") if LABS.exists() else ():
            teardown(record.stem, int(json.loads(record.read_text())["hosts"]))
        return 0
    print(__doc__, file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
