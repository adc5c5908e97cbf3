"""The files a test Slurm cluster reads: ``slurm.conf``, ``cgroup.conf`` and the hosts
file every namespace sees. Pure text, built from the cluster's names and addresses."""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path

SLURM_CONF = """\
ClusterName=shardwire
SlurmctldHost={controller}({controller_addr})
AuthType=auth/munge
AuthInfo=socket={munge_socket}
CredType=cred/munge
SlurmUser=root
SlurmdUser=root
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
# Nodes claim more CPUs than the machine has; take slurm.conf's word for it.
SlurmdParameters=config_overrides
MpiDefault=none
ReturnToService=2
KillWait=5
# Batch jobs otherwise wait up to 3 s (batch_sched_delay) for the scheduler to start them.
SchedulerParameters=batch_sched_delay=0
StateSaveLocation={root}/state
SlurmdSpoolDir={spool}/%n
SlurmctldPidFile={root}/run/slurmctld.pid
SlurmdPidFile={root}/run/slurmd.%n.pid
SlurmctldLogFile={root}/log/slurmctld.log
SlurmdLogFile={root}/log/slurmd.%n.log
SlurmctldDebug=info
SlurmdDebug=info
SlurmctldPort=6817
SlurmdPort=6818
{node_lines}
PartitionName=debug Nodes=ALL Default=YES MaxTime=INFINITE State=UP OverSubscribe=FORCE:4
"""

# ``ip netns exec`` mounts a fresh /sys without the cgroup hierarchies, where slurmd's
# cgroup autodetection fails and stops it ("No filesystem mounted on /sys/fs/cgroup");
# naming the plugin skips the detection, and proctrack/linuxproc with task/none never
# creates a cgroup.
CGROUP_CONF = "CgroupPlugin=cgroup/v1\n"


def slurm_conf(
    *,
    root: Path,
    controller: str,
    addresses: Mapping[str, str],
    nodes: tuple[str, ...],
    cpus: int,
    munge_socket: Path,
    spool: Path,
) -> str:
    """``slurm.conf`` for ``controller`` and ``nodes``, keeping every file under ``root``
    but the nodes' spool directories, under ``spool``."""
    node_lines = "\n".join(
        f"NodeName={node} NodeAddr={addresses[node]} CPUs={cpus} RealMemory=1000 State=UNKNOWN"
        for node in nodes
    )
    return SLURM_CONF.format(
        controller=controller,
        controller_addr=addresses[controller],
        munge_socket=munge_socket,
        root=root,
        spool=spool,
        node_lines=node_lines,
    )


def hosts_file(addresses: Mapping[str, str]) -> str:
    """``/etc/hosts`` text naming every host of the cluster."""
    return "127.0.0.1 localhost\n" + "".join(f"{ip} {name}\n" for name, ip in addresses.items())
