"""Coordinator settings: every flag is also ``SHARDWIRE_<FLAG>`` in the environment."""

from __future__ import annotations

from pydantic import Field, SecretStr, field_validator
from pydantic_settings import BaseSettings, SettingsConfigDict

from shardwire.protocol.ports import port_value


class CoordinatorSettings(BaseSettings):
    """Options of ``shardwire coordinator``."""

    model_config = SettingsConfigDict(env_prefix="SHARDWIRE_", extra="ignore")

    host: str = "127.0.0.1"
    port: int = Field(default=29400, ge=0, le=65535)
    world_size: int | None = Field(default=None, ge=1)
    run_id: str = "shardwire"
    token: SecretStr | None = Field(
        default=None, description="The job's shared secret (or a token file)."
    )
    token_file: str | None = None
    insecure: bool = False
    join_timeout: float = Field(default=300.0, gt=0)
    heartbeat_timeout: float = Field(default=5.0, gt=0)
    diagnose_timeout: float = Field(default=3.0, gt=0)
    max_restarts: int | None = Field(default=None, ge=0, le=1 << 20)  # None: the agents'
    nnodes: str | None = None  # MIN:MAX for an elastic job; None: the agents say
    last_call: float = Field(default=3.0, ge=0)
    inquest_dir: str = "inquests"  # relative to the coordinator's directory; "": none
    port_file: str | None = None
    http_host: str = "127.0.0.1"
    http_port: int = Field(default=29480, ge=-1, le=65535)  # -1: no HTTP
    log_level: str = "INFO"
    tls_cert: str | None = None
    tls_key: str | None = None
    tls_ca: str | None = None
    # a journal of the running generation, so a coordinator restarted on it resumes the job
    state_dir: str | None = None
    coordinator_grace: float = Field(default=60.0, gt=0, le=86400)
    respawn: int = Field(default=0, ge=0, le=100)  # starts again when a signal kills it
    # replicas: the journal in etcd (comma-separated endpoints), one leader under a lease
    etcd: str | None = None
    etcd_ttl: int = Field(default=2, ge=2, le=600)  # etcd grants 2 s at the least

    @field_validator("port", "http_port", mode="before")
    @classmethod
    def _port(cls, value: object, info: object) -> object:
        return port_value(value, f"SHARDWIRE_{getattr(info, 'field_name', 'port').upper()}")
