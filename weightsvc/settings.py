"""The one settings object. Every field can come from a CLI flag or a `WEIGHTSVC_*` variable."""

from __future__ import annotations

import os
from pathlib import Path

from pydantic import Field, SecretStr, field_validator, model_validator
from pydantic_settings import BaseSettings, SettingsConfigDict

from weightsvc.rounding import DEFAULT_FP8_PATTERN, FORMATS, ROUNDINGS, SCALINGS, ExportSpec, check_choice
from weightsvc.transport.auth import Auth

# This build exports on the CPU; 'auto' picks it (the GPU kernel comes with the numerics work).
DEVICES = ("auto", "cpu")


def _physical_memory() -> int:
    """The memory this process may use: the machine's, or its cgroup's limit when lower (a pod)."""
    total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    for path in ("/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory/memory.limit_in_bytes"):
        try:
            limit = Path(path).read_text().strip()
        except OSError:
            continue
        if limit.isdigit():
            total = min(total, int(limit))
    return total


class Settings(BaseSettings):
    model_config = SettingsConfigDict(env_prefix="WEIGHTSVC_", extra="ignore")

    host: str = "127.0.0.1"
    grpc_port: int = Field(50051, ge=0, le=65535)
    http_port: int = Field(8080, ge=0, le=65535)
    data_dir: Path | None = None
    format: str = "bf16"
    rounding: str = "sr"
    seed: int = Field(0, ge=0, lt=1 << 64)
    scaling: str = "block"  # fp8 scales: tensor, channel or block (128x128)
    fp8_pattern: str = DEFAULT_FP8_PATTERN  # regex of the 2-D tensor names served in fp8
    device: str = "auto"
    retain: int = Field(4, ge=1)
    # gRPC messages are sized to chunks, never to tensors: 1 MiB chunks, up to 4 MiB accepted,
    # plus room for the header of a model with tens of thousands of tensors.
    chunk_bytes: int = Field(1 << 20, ge=4096, le=4 << 20)
    max_message_bytes: int = Field(8 << 20, ge=64 << 10)
    allow_nonfinite: bool = False
    # Size limits: master bytes of one version, and served bytes staged by all pushes in progress.
    max_version_bytes: int = Field(default_factory=lambda: _physical_memory() // 2, ge=1)
    max_staged_bytes: int = Field(default_factory=lambda: _physical_memory() // 2, ge=1)
    max_tensors: int = Field(1_000_000, ge=1)  # per version
    max_tensor_bytes: int = Field(default_factory=lambda: _physical_memory() // 2, ge=1)  # master bytes of one
    # Streams served at once; beyond them a new one gets RESOURCE_EXHAUSTED (HTTP 429), not a slow death.
    max_pushes: int = Field(64, ge=1)  # push streams (each rank of a multi-rank push is one)
    max_pulls: int = Field(1024, ge=1)  # gRPC and HTTP pulls
    # High-water mark of this process's resident memory: no new push is staged above it (0: 90% of
    # the memory this process may use).
    max_rss_bytes: int = Field(0, ge=0)
    # A push that sends nothing for this long is abandoned and freed.
    push_idle_timeout_s: float = Field(120.0, gt=0)
    # A pull whose client reads nothing for this long is dropped, and its version released.
    pull_stall_timeout_s: float = Field(120.0, gt=0)
    # A multi-rank push whose ranks have not all sent their headers this long after the first is
    # abandoned (a rank that crashed or was never started) and nothing of it is visible.
    push_rank_timeout_s: float = Field(60.0, gt=0)
    # Bearer tokens per role, comma-separated (see weightsvc/_auth.py); none at all: auth is off.
    pull_tokens: SecretStr | None = None
    push_tokens: SecretStr | None = None
    admin_tokens: SecretStr | None = None
    auth_file: Path | None = None
    auth_open_paths: str = "/healthz,/readyz,/metrics"  # HTTP paths that need no token
    # TLS for gRPC and HTTP (PEM files); both or neither.
    tls_cert: Path | None = None
    tls_key: Path | None = None
    # Redis URL of the shared registry (redis://host:6379/0); unset: the embedded, in-process one.
    redis_url: str | None = None
    redis_prefix: str = "weightsvc"  # key prefix: deployments sharing one Redis keep apart
    # This replica's stable name (a pod name; default <hostname>-<grpc port>) and the host clients
    # reach it by (default: --host, or the hostname when bound to all interfaces).
    replica_id: str = ""
    advertise_host: str = ""
    # gRPC HOST:PORT of an upstream weightsvc to mirror (a relay); pushes are then refused here.
    relay_from: str | None = None
    log_level: str = "info"

    @model_validator(mode="after")
    def _tls_pair(self) -> Settings:
        if (self.tls_cert is None) != (self.tls_key is None):
            raise ValueError("--tls-cert and --tls-key go together")
        return self

    @field_validator("format")
    @classmethod
    def _format(cls, v: str) -> str:
        return check_choice("format", v, FORMATS)

    @field_validator("rounding")
    @classmethod
    def _rounding(cls, v: str) -> str:
        return check_choice("rounding", v, ROUNDINGS)

    @field_validator("scaling")
    @classmethod
    def _scaling(cls, v: str) -> str:
        return check_choice("scaling", v, SCALINGS)

    @field_validator("device")
    @classmethod
    def _device(cls, v: str) -> str:
        return check_choice("device", v, DEVICES)

    @property
    def rss_high_water(self) -> int:
        return self.max_rss_bytes or int(_physical_memory() * 0.9)

    def auth(self) -> Auth | None:
        secrets = {"pull": self.pull_tokens, "push": self.push_tokens, "admin": self.admin_tokens}
        return Auth.load({r: s.get_secret_value() if s else None for r, s in secrets.items()}, self.auth_file)

    @property
    def export_spec(self) -> ExportSpec:
        return ExportSpec(self.format, self.rounding, self.seed, self.scaling, self.fp8_pattern)
