"""A real two-node Slurm cluster on one machine, for tests that submit jobs with ``srun``
and ``sbatch``.

Theory of operation: three network namespaces on one bridge (``make_hosts`` with its own
subnet 10.77.1.0/24 and name prefix, so it never meets the ``hosts`` fixture). The first
holds ``slurmctld`` and is where client commands run (the submit host, ``swctl``,
10.77.1.1); each of the others holds one ``slurmd`` (``swnode1`` at 10.77.1.2,
``swnode2`` at 10.77.1.3). Every daemon runs in its own UTS namespace too, so
``hostname`` inside a job prints the node's name. ``ip netns exec NS`` bind-mounts
``/etc/netns/NS/hosts`` over ``/etc/hosts``; those files map every name to its address,
and job tasks, being children of ``slurmd``, inherit that view. One ``munged`` in the
root namespace serves everyone through a socket file (path sockets cross network
namespaces). Every file lives under ``tmp_path / "slurm"`` but the nodes' spool
directories, which hold sockets and so live in a short temporary directory (a socket's
path has at most 107 bytes), and every client and daemon reads ``SLURM_CONF`` from
there; the daemons' ports are Slurm's defaults, which cannot clash with anything because
each daemon has a network namespace of its own. Clusters of test processes run side by
side do not meet: each has its own namespaces, munged and files.

Where a daemon cannot start, ``slurm_cluster`` skips the test with the daemon's log tail.
Teardown cancels every job, stops the daemons by PID (SIGTERM, then SIGKILL), kills
whatever still runs in the cluster's namespaces, stops ``munged`` and removes the
namespaces and the ``/etc/netns`` entries.

API::

    with slurm_cluster(tmp_path, nodes=2) as cluster:   # or the ``slurm`` fixture
        cluster.nodes                  # ("swnode1", "swnode2")
        cluster.addresses["swnode1"]   # "10.77.1.2"; also the controller's
        cluster.run("srun", "-N2", "hostname")          # CompletedProcess, text
        cluster.popen("srun", ...)     # the same in the background, pipes as text
        cluster.sbatch_wait(script, "-N2")  # JobEnd(job_id, state, exit_code, signal)
        cluster.log_tail()             # the daemons' logs, for assertion messages

``run`` and ``popen`` take ``env=`` (added to the caller's environment, which srun and
sbatch export to the tasks) and ``cwd=`` (default ``tmp_path / "slurm" / "jobs"``, where
``slurm-%j.out`` lands). Each node has ``cpus`` CPUs (4 by default, two nodes on a
two-core machine, trusted through ``SlurmdParameters=config_overrides``); a step with
more tasks than that needs ``srun --overcommit``, and the partition lets jobs share
nodes (``OverSubscribe=FORCE:4``).
"""

from __future__ import annotations

import contextlib
import os
import re
import shutil
import signal
import subprocess
import tempfile
import time
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import NamedTuple

import pytest

from .netns import make_hosts
from .slurmconf import CGROUP_CONF, hosts_file, slurm_conf

SUBNET = "10.77.1"
CONTROLLER = "swctl"
DAEMONS = ("munged", "slurmctld", "slurmd", "sinfo", "srun", "sbatch", "scontrol", "unshare")
FINISHED = frozenset(
    "COMPLETED FAILED CANCELLED TIMEOUT NODE_FAIL OUT_OF_MEMORY PREEMPTED BOOT_FAIL "
    "DEADLINE".split()
)


class JobEnd(NamedTuple):
    """How a batch job ended, as ``scontrol show job`` reports it."""

    job_id: str
    state: str  # COMPLETED, FAILED, CANCELLED, TIMEOUT, ...
    exit_code: int
    signal: int


def _tail(path: Path, lines: int) -> str:
    try:
        text = path.read_text(errors="replace")
    except FileNotFoundError:
        return f"== {path.name}: (missing)"
    return f"== {path.name}:\n" + "\n".join(text.splitlines()[-lines:])


def _poll(ready: Callable[[], bool], timeout: float) -> bool:
    """Whether ``ready()`` came true within ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    while not ready():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.2)  # daemons announce readiness nowhere we can block on
    return True


def _stop(proc: subprocess.Popen, grace: float = 10) -> None:
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(timeout=grace)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout=grace)


def _kill_namespace_pids(namespace: str) -> None:
    """SIGKILL what is left in one of our namespaces (steps whose slurmd is gone)."""
    found = subprocess.run(
        ["ip", "netns", "pids", namespace],
        capture_output=True,
        text=True,
        timeout=10,
        check=False,
    )
    for pid in found.stdout.split():
        with contextlib.suppress(ProcessLookupError):
            os.kill(int(pid), signal.SIGKILL)


class Cluster:
    """A running cluster; built by ``slurm_cluster``, not directly."""

    def __init__(self, root: Path, spool: Path, namespaces: list[str], *, cpus: int) -> None:
        self.root = root
        self.spool = spool  # the nodes' spool directories: slurmstepd's sockets
        self.workdir = root / "jobs"
        self.conf = root / "slurm.conf"
        self.nodes = tuple(f"swnode{i}" for i in range(1, len(namespaces)))
        names = (CONTROLLER, *self.nodes)
        self.addresses = {name: f"{SUBNET}.{i}" for i, name in enumerate(names, start=1)}
        self.namespaces = dict(zip(names, namespaces, strict=True))
        self.cpus = cpus
        self.munge_socket = root / "munge" / "munge.socket"
        self._daemons: dict[str, subprocess.Popen] = {}
        self._made_etc_netns = not Path("/etc/netns").exists()

    def env(self, extra: Mapping[str, str] | None = None) -> dict[str, str]:
        """The caller's environment without any outer job's SLURM_*, with SLURM_CONF."""
        base = {k: v for k, v in os.environ.items() if not k.startswith("SLURM_")}
        return {**base, **(extra or {}), "SLURM_CONF": str(self.conf)}

    def run(
        self,
        *cmd: str,
        env: Mapping[str, str] | None = None,
        timeout: float = 120,
        cwd: Path | None = None,
    ) -> subprocess.CompletedProcess:
        """Run a client command (srun, sbatch, squeue, ...) on the submit host.

        ``env`` adds to the caller's environment, which srun and sbatch pass on to the
        tasks. The working directory defaults to ``tmp_path / "slurm" / "jobs"``.
        """
        return subprocess.run(
            ["ip", "netns", "exec", self.namespaces[CONTROLLER], *cmd],
            env=self.env(env),
            cwd=cwd or self.workdir,
            capture_output=True,
            text=True,
            timeout=timeout,
            check=False,
            stdin=subprocess.DEVNULL,
        )

    def popen(
        self,
        *cmd: str,
        env: Mapping[str, str] | None = None,
        cwd: Path | None = None,
    ) -> subprocess.Popen:
        """Start a client command (``srun ...``) on the submit host in the background.

        Output is piped as text; the caller waits for it or kills it (a killed srun's
        step is cancelled by Slurm, and teardown cancels whatever is left).
        """
        return subprocess.Popen(
            ["ip", "netns", "exec", self.namespaces[CONTROLLER], *cmd],
            env=self.env(env),
            cwd=cwd or self.workdir,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )

    def sbatch_wait(
        self,
        script: Path,
        *args: str,
        timeout: float = 120,
        env: Mapping[str, str] | None = None,
        cwd: Path | None = None,
    ) -> JobEnd:
        """Submit ``sbatch ARGS SCRIPT``, wait until the job ends and say how it ended.

        Raises AssertionError when sbatch refuses the job and TimeoutError (after
        cancelling the job) when it has not ended within ``timeout`` seconds.
        """
        submitted = self.run("sbatch", "--parsable", *args, str(script), env=env, cwd=cwd)
        if submitted.returncode != 0:
            raise AssertionError(f"sbatch exited {submitted.returncode}: {submitted.stderr}")
        job_id = submitted.stdout.strip().split(";")[0]
        deadline = time.monotonic() + timeout
        while True:
            shown = self.run("scontrol", "show", "job", "-o", job_id, timeout=30).stdout
            state = re.search(r"\bJobState=(\S+)", shown)
            if state and state.group(1) in FINISHED:
                code = re.search(r"\bExitCode=(\d+):(\d+)", shown)
                assert code, f"no ExitCode in {shown!r}"
                return JobEnd(job_id, state.group(1), int(code.group(1)), int(code.group(2)))
            if time.monotonic() > deadline:
                self.run("scancel", job_id, timeout=30)
                raise TimeoutError(
                    f"job {job_id} still {state and state.group(1)} after {timeout} s\n"
                    + self.log_tail()
                )
            time.sleep(0.2)  # scontrol is the only way to learn the state; poll it gently

    def log_tail(self, lines: int = 25) -> str:
        """The last lines of every daemon's log, for failure messages."""
        logs = sorted((self.root / "log").iterdir()) if (self.root / "log").exists() else []
        return "\n".join(_tail(path, lines) for path in logs)

    def _write_files(self) -> None:
        for sub in ("munge", "state", "run", "log", "jobs"):
            (self.root / sub).mkdir(mode=0o700, parents=True, exist_ok=True)
        for node in self.nodes:
            (self.spool / node).mkdir(mode=0o700, parents=True, exist_ok=True)
        (self.root / "cgroup.conf").write_text(CGROUP_CONF)
        key = self.root / "munge" / "munge.key"
        key.write_bytes(os.urandom(1024))
        key.chmod(0o400)
        self.conf.write_text(
            slurm_conf(
                root=self.root,
                controller=CONTROLLER,
                addresses=self.addresses,
                nodes=self.nodes,
                cpus=self.cpus,
                munge_socket=self.munge_socket,
                spool=self.spool,
            )
        )
        hosts = hosts_file(self.addresses)
        for namespace in self.namespaces.values():
            etc = Path("/etc/netns") / namespace
            etc.mkdir(parents=True, exist_ok=True)
            (etc / "hosts").write_text(hosts)

    def _spawn(self, name: str, cmd: list[str]) -> None:
        with open(self.root / "log" / f"{name}.out", "wb") as out:
            self._daemons[name] = subprocess.Popen(
                cmd,
                env=self.env(),
                cwd=self.root,
                stdin=subprocess.DEVNULL,
                stdout=out,
                stderr=subprocess.STDOUT,
            )

    def _inside(self, host: str, *cmd: str) -> list[str]:
        """``cmd`` in ``host``'s network namespace, with ``host`` as its hostname."""
        script = f'hostname {host} && exec "$@"'
        netns = ["ip", "netns", "exec", self.namespaces[host]]
        return [*netns, "unshare", "--uts", "sh", "-c", script, "sh", *cmd]

    def _start_munge(self) -> None:
        munge = self.root / "munge"
        self._spawn(
            "munged",
            [
                "munged",
                "--foreground",
                # Without it munged refuses a socket directory that not everyone may
                # search (ours is 0700 inside pytest's 0700 tmp); only root uses it.
                "--force",
                f"--key-file={munge / 'munge.key'}",
                f"--socket={self.munge_socket}",
                f"--pid-file={munge / 'munged.pid'}",
                # In the foreground munged logs to stderr (log/munged.out) instead.
                f"--log-file={self.root / 'log' / 'munged.log'}",
                f"--seed-file={munge / 'munged.seed'}",
            ],
        )
        self._wait(self.munge_socket.exists, "munged to create its socket", 20)

    def start(self, timeout: float) -> None:
        """Start munged, slurmctld and the slurmds; skip the test if they never come up."""
        self._write_files()
        self._start_munge()
        self._spawn("slurmctld", self._inside(CONTROLLER, "slurmctld", "-D"))
        for node in self.nodes:
            self._spawn(node, self._inside(node, "slurmd", "-D", "-N", node))
        self._wait(self._all_idle, "every node to be idle in sinfo", timeout)

    def _all_idle(self) -> bool:
        try:
            shown = self.run("sinfo", "-h", "-N", "-o", "%N %t", timeout=20).stdout
        except subprocess.TimeoutExpired:
            return False
        return sorted(shown.splitlines()) == [f"{node} idle" for node in self.nodes]

    def _dead(self) -> list[str]:
        return [name for name, proc in self._daemons.items() if proc.poll() is not None]

    def _wait(self, ready: Callable[[], bool], what: str, timeout: float) -> None:
        if not _poll(lambda: ready() or bool(self._dead()), timeout) or self._dead():
            dead = self._dead()
            why = f"{', '.join(dead)} exited" if dead else f"not within {timeout} s"
            pytest.skip(f"Slurm cluster: waited for {what}, {why}\n{self.log_tail()}")

    def close(self) -> None:
        """Cancel the jobs, stop the daemons and leave no process behind."""
        try:
            self._cancel_jobs()
        finally:
            for name in (*self.nodes, "slurmctld"):
                if name in self._daemons:
                    _stop(self._daemons[name])
            for namespace in self.namespaces.values():
                _kill_namespace_pids(namespace)
                shutil.rmtree(Path("/etc/netns") / namespace, ignore_errors=True)
            if self._made_etc_netns:
                with contextlib.suppress(OSError):
                    Path("/etc/netns").rmdir()
            if "munged" in self._daemons:
                _stop(self._daemons["munged"])

    def _cancel_jobs(self) -> None:
        """scancel every job and give them KillWait and some to end (steps end cleanly)."""
        controller = self._daemons.get("slurmctld")
        if controller is None or controller.poll() is not None:
            return
        with contextlib.suppress(subprocess.TimeoutExpired):
            if jobs := self._jobs():
                self.run("scancel", *jobs, timeout=20)
                _poll(lambda: not self._jobs(), 30)

    def _jobs(self) -> list[str]:
        """Pending, running and completing jobs."""
        return self.run("squeue", "-h", "-o", "%i", timeout=20).stdout.split()


@contextlib.contextmanager
def slurm_cluster(tmp_path: Path, *, nodes: int = 2, cpus: int = 4, timeout: float = 60):
    """A running Slurm cluster of ``nodes`` nodes with ``cpus`` CPUs each.

    Skips the test (with the reason and the daemons' logs) where namespaces, munge or
    Slurm are missing or do not come up within ``timeout`` seconds.
    """
    missing = [name for name in DAEMONS if shutil.which(name) is None]
    if missing:
        packages = "slurmctld slurmd slurm-client munge util-linux iproute2"
        pytest.skip(f"Slurm cluster needs {', '.join(missing)} (Debian: {packages})")
    with contextlib.ExitStack() as stack:
        hosts = contextlib.contextmanager(make_hosts)
        namespaces = stack.enter_context(hosts(nodes + 1, subnet=SUBNET, prefix="sl"))
        # slurmstepd's socket for a batch step is SPOOL/NODE_JOB.4294967291: under a test
        # process's tmp_path it would pass the 107 bytes a socket's path may have
        spool = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="swslurm-")))
        cluster = Cluster(tmp_path / "slurm", spool, namespaces, cpus=cpus)
        stack.callback(cluster.close)
        cluster.start(timeout)
        yield cluster
