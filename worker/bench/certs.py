"""Throw-away certificates for TLS benchmarks and tests, made with the openssl command: a
job CA with one member certificate (for 127.0.0.1), and a second, unrelated CA with its
own member (a stranger). The caller owns the directory and removes it."""

from __future__ import annotations

import subprocess
from dataclasses import dataclass
from pathlib import Path

from shardwire.worker.runtime.tls import TlsFiles

_CURVE = ["-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes"]


def _openssl(*args: str, cwd: Path) -> None:
    subprocess.run(["openssl", *args], cwd=cwd, check=True, capture_output=True, timeout=60)


def _authority(directory: Path, name: str) -> TlsFiles:
    """A CA called ``name`` and one member certificate it signed."""
    _openssl(
        "req",
        "-x509",
        *_CURVE,
        "-keyout",
        f"{name}-ca.key",
        "-out",
        f"{name}-ca.pem",
        "-days",
        "2",
        "-subj",
        f"/CN={name} test CA",
        "-addext",
        "basicConstraints=critical,CA:TRUE",
        "-addext",
        "keyUsage=critical,keyCertSign,cRLSign",
        cwd=directory,
    )
    _openssl(
        "req",
        *_CURVE,
        "-keyout",
        f"{name}.key",
        "-out",
        f"{name}.csr",
        "-subj",
        f"/CN={name} member",
        cwd=directory,
    )
    (directory / f"{name}.ext").write_text(
        "basicConstraints=CA:FALSE\n"
        "keyUsage=critical,digitalSignature\n"
        "extendedKeyUsage=serverAuth,clientAuth\n"
        "subjectAltName=IP:127.0.0.1\n"
    )
    _openssl(
        "x509",
        "-req",
        "-in",
        f"{name}.csr",
        "-CA",
        f"{name}-ca.pem",
        "-CAkey",
        f"{name}-ca.key",
        "-CAcreateserial",
        "-out",
        f"{name}.pem",
        "-days",
        "2",
        "-extfile",
        f"{name}.ext",
        cwd=directory,
    )
    return TlsFiles(
        cert=str(directory / f"{name}.pem"),
        key=str(directory / f"{name}.key"),
        ca=str(directory / f"{name}-ca.pem"),
    )


@dataclass(frozen=True)
class Certificates:
    member: TlsFiles  # signed by the job's CA
    stranger: TlsFiles  # signed by another CA


def make_certificates(directory: Path) -> Certificates:
    return Certificates(_authority(directory, "job"), _authority(directory, "other"))
