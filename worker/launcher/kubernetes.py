"""``shardwire kubernetes``: render the Kubernetes objects of a job of N worker nodes as
multi-document YAML: the coordinator's Job and Service, and an Indexed Job of node
agents with its headless Service (the design: :mod:`shardwire.worker.launcher.manifests`).
Nothing is read from the environment: the same command renders the same manifests."""

from __future__ import annotations

import argparse
import math
import re
import shlex
import sys
from fractions import Fraction
from pathlib import Path

from shardwire.worker.launcher.manifests import (
    CONTROL_PORT,
    DEFAULT_IMAGE,
    HTTP_PORT,
    Deployment,
    GiB,
    default_shm_bytes,
    manifests,
    number,
    quantity,
)
from shardwire.worker.launcher.yamldoc import dump_all

_LABEL = r"[a-z0-9]([-a-z0-9]*[a-z0-9])?"
_DNS1035 = re.compile(r"[a-z]([-a-z0-9]*[a-z0-9])?\Z")  # Service names
_DNS1123 = re.compile(_LABEL + r"\Z")
_SUBDOMAIN = re.compile(rf"{_LABEL}(\.{_LABEL})*\Z")
_CPU = re.compile(r"(\d+(\.\d+)?|\.\d+|\d+m)\Z")
_MEMORY = re.compile(r"(\d+(?:\.\d+)?)(Ki|Mi|Gi|Ti|k|M|G|T)?\Z")
_UNITS = {"Ki": 1 << 10, "Mi": 1 << 20, "Gi": 1 << 30, "Ti": 1 << 40}
_UNITS |= {"k": 10**3, "M": 10**6, "G": 10**9, "T": 10**12, "": 1}
_SUFFIX = "-coordinator"
_SHM2, _SHM8 = quantity(default_shm_bytes(2)), quantity(default_shm_bytes(8))
_EXAMPLES = f"""examples:
  shardwire kubernetes --name digits --nodes 2 --nproc-per-node 2 examples/digits.py \\
      --steps 200 --run-dir /tmp/run | kubectl apply -f -
  shardwire kubernetes --name llm --namespace ml --nodes 8 --nproc-per-node 8 \\
      --image registry.example/llm:1 --max-restarts 3 -o llm.yaml -m llm.train --lr 3e-4

The pods read the token from the Secret NAME-token (key: token), made beforehand:
  kubectl create secret generic digits-token \\
      --from-literal=token=$(python3 -c 'import secrets;print(secrets.token_hex(32))')
Options go before SCRIPT; what follows it is the script's. Defaults: one CPU and 1Gi
per process; /dev/shm sized for shardwire's node arenas and point-to-point segments
({_SHM2} for 2 processes per pod, {_SHM8} for 8). The memory limit is --memory plus
--shm-size: /dev/shm pages count against it."""
# Recorded in the rendering's first line, in this order, when not at their defaults.
_RECORDED = (
    "--name",
    "--namespace",
    "--nodes",
    "--nproc-per-node",
    "--image",
    "--max-restarts",
    "--join-timeout",
    "--token-secret",
    "--port",
    "--http-port",
    "--cpu",
    "--memory",
    "--shm-size",
)


def _checked(pattern: re.Pattern[str], what: str, limit: int = 63):
    def check(text: str) -> str:
        if not pattern.match(text) or len(text) > limit:
            raise argparse.ArgumentTypeError(f"{what} (at most {limit} characters), got {text!r}")
        return text

    return check


def _name(text: str) -> str:
    _checked(
        _DNS1035,
        "must be a DNS-1035 label, as Service names are: lower-case letters, digits and "
        "'-', starting with a letter and ending with a letter or digit",
    )(text)
    if len(text) + len(_SUFFIX) > 63:
        raise argparse.ArgumentTypeError(
            f"{text!r} has {len(text)} characters; {text}{_SUFFIX} must fit in a DNS "
            f"label's 63, so the name may have {63 - len(_SUFFIX)} at most"
        )
    return text


def _int_at_least(low: int, high: int = 1 << 20):
    def check(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected a whole number, got {text!r}") from None
        if not low <= value <= high:
            raise argparse.ArgumentTypeError(f"expected {low} to {high}, got {value}")
        return value

    return check


def _seconds(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        value = math.nan
    if not (math.isfinite(value) and value > 0):
        raise argparse.ArgumentTypeError(f"expected seconds > 0, got {text!r}")
    return value


def _cpu(text: str) -> str:
    if not _CPU.match(text) or float(text.rstrip("m")) <= 0:
        raise argparse.ArgumentTypeError(f"expected CPUs as 2, 1.5 or 500m, got {text!r}")
    return text


def bytes_of(text: str) -> int:
    """A Kubernetes memory quantity (``2Gi``, ``512Mi``, ``1.5G``, ``1048576``) in bytes."""
    found = _MEMORY.match(text)
    size = math.ceil(Fraction(found[1]) * _UNITS[found[2] or ""]) if found else 0
    if size <= 0:
        raise argparse.ArgumentTypeError(f"expected bytes as 2Gi, 512Mi or 1.5G, got {text!r}")
    return size


def _image(text: str) -> str:
    if not text or any(ch.isspace() for ch in text):
        raise argparse.ArgumentTypeError(f"expected an image reference, got {text!r}")
    return text


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="shardwire kubernetes",
        description="Render the Kubernetes objects of a job of N worker nodes as YAML: the\n"
        "coordinator's Job and Service, an Indexed Job of node agents and its headless\n"
        "Service. The same command renders the same manifests (no environment is read).",
        epilog=_EXAMPLES,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    add = p.add_argument
    add("--name", required=True, type=_name, help="the job: its objects' names and run id")
    namespace = _checked(_DNS1123, "must be a DNS-1123 label")
    add("--namespace", type=namespace, metavar="NS", help="of every object (kubectl's)")
    add("--nodes", type=_int_at_least(1), default=1, metavar="N", help="worker pods (1)")
    add(
        "--nproc-per-node",
        type=_int_at_least(1, 1024),
        default=1,
        metavar="K",
        help="processes per worker pod (1)",
    )
    add(
        "--image",
        type=_image,
        default=DEFAULT_IMAGE,
        help=f"the container image of the coordinator and worker pods (default {DEFAULT_IMAGE})",
    )
    add(
        "--max-restarts",
        type=_int_at_least(0),
        default=0,
        metavar="R",
        help="failures the job recovers from, as --recovery says, and the Job's backoffLimit (0)",
    )
    add(
        "--recovery",
        choices=["relaunch", "live"],
        default="live",
        help="after a rank's failure, start only the failed rank while the others re-form "
        "in their processes (live), or start every process again (relaunch) (live)",
    )
    add(
        "--join-timeout",
        type=_seconds,
        default=300.0,
        metavar="SECONDS",
        help="to form the world (300)",
    )
    add(
        "--token-secret",
        type=_checked(_SUBDOMAIN, "must be a DNS-1123 subdomain", 253),
        metavar="SECRET",
        help="Secret holding the job's token under the key 'token' (NAME-token)",
    )
    add("--port", type=_int_at_least(1, 65535), default=CONTROL_PORT, help=f"({CONTROL_PORT})")
    add(
        "--http-port",
        type=_int_at_least(1, 65535),
        default=HTTP_PORT,
        help=f"status page, probes and /metrics ({HTTP_PORT})",
    )
    add("--cpu", type=_cpu, help="CPUs per worker pod, as 4 or 3500m (one per process)")
    add("--memory", type=bytes_of, help="per worker pod besides /dev/shm (1Gi per process)")
    add("--shm-size", type=bytes_of, metavar="SIZE", help="/dev/shm per worker pod (see below)")
    add("-o", "--output", metavar="FILE", help="write the YAML here (default: standard output)")
    add("-m", "--module", action="store_true", help="run SCRIPT as a module")
    add("script", help="training script (or module with -m), as the image sees it")
    add("args", nargs=argparse.REMAINDER, help="arguments for the script")
    return p


def deployment(args: argparse.Namespace) -> Deployment:
    k = args.nproc_per_node
    return Deployment(
        name=args.name,
        command=(*(["-m"] if args.module else []), args.script, *args.args),
        nodes=args.nodes,
        nproc_per_node=k,
        namespace=args.namespace,
        image=args.image,
        max_restarts=args.max_restarts,
        recovery=args.recovery,
        join_timeout=args.join_timeout,
        token_secret=args.token_secret or "",
        port=args.port,
        http_port=args.http_port,
        cpu=args.cpu or str(k),
        memory_bytes=args.memory or k * GiB,
        shm_bytes=args.shm_size or default_shm_bytes(k),
    )


def command_line(p: argparse.ArgumentParser, args: argparse.Namespace) -> str:
    """The command that renders these manifests again (without --output)."""
    words = ["shardwire", "kubernetes"]
    for flag in _RECORDED:
        dest = flag[2:].replace("-", "_")
        value = getattr(args, dest)
        if value is not None and value != p.get_default(dest):
            words += [flag, quantity(value) if flag in ("--memory", "--shm-size") else value]
    words += ["-m"] if args.module else []
    words = [number(w) if isinstance(w, float) else str(w) for w in words]
    return shlex.join([*words, args.script, *args.args])


def _comments(command: str, d: Deployment) -> list[str]:
    namespace = f" --namespace {d.namespace}" if d.namespace else ""
    return [
        f"Rendered by: {command}",
        "Render again to change it. The pods need the Secret with the job's token:",
        f"  kubectl create secret generic {d.secret}{namespace} --from-literal="
        "token=$(python3 -c 'import secrets;print(secrets.token_hex(32))')",
    ]


def render(argv: list[str]) -> str:
    """The YAML ``shardwire kubernetes ARGV`` writes; exits 2 on invalid options."""
    p = parser()
    return _render(p, p.parse_args(argv))


def _render(p: argparse.ArgumentParser, args: argparse.Namespace) -> str:
    if args.port == args.http_port:
        p.error(f"--port and --http-port must differ, both are {args.port}")
    d = deployment(args)
    try:
        return dump_all(manifests(d), comments=_comments(command_line(p, args), d))
    except ValueError as exc:  # an argument YAML cannot hold
        p.error(str(exc))


def main(argv: list[str]) -> int:
    p = parser()
    args = p.parse_args(argv)
    text = _render(p, args)
    if args.output:
        Path(args.output).write_text(text, encoding="utf-8")
    else:
        sys.stdout.write(text)
    return 0
