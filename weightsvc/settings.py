"""The one settings object. Every field can come from a `weightsvc serve` flag or a `WEIGHTSVC_*` variable.

`weightsvc serve` builds its flags from these fields (name, type, default, description), so a field
added here is a flag there. This module imports neither torch nor numba: the command line reads it
to print `serve --help` and to reject a bad value before anything heavy loads.
"""

from __future__ import annotations

from pathlib import Path

from pydantic import Field, SecretStr, ValidationInfo, field_validator, model_validator
from pydantic_settings import BaseSettings, SettingsConfigDict

from weightsvc.memory import half_the_memory, physical_memory

# The choices a deployment may set are what the rounding package implements (importing it loads
# no kernel).
from weightsvc.rounding import DEFAULT_FP8_PATTERN, DEVICES, FORMATS, ROUNDINGS, SCALINGS, check_choice


class Settings(BaseSettings):
    model_config = SettingsConfigDict(env_prefix="WEIGHTSVC_", extra="ignore")

    # ---- where it listens and keeps its data
    host: str = Field("127.0.0.1", description="Address to bind.")
    grpc_port: int = Field(50051, ge=0, le=65535, description="gRPC port (0 picks one).")
    http_port: int = Field(8080, ge=0, le=65535, description="HTTP port (0 picks one).")
    probe_port: int = Field(
        8081, ge=0, le=65535,
        description="Port of /healthz and /readyz answered off the event loop, plain HTTP without a token, for "
        "Kubernetes probes (0 picks one).",
    )
    loop_wedged_s: float = Field(
        30.0, gt=0,
        description="/healthz and /readyz answer 503 once the event loop has not turned for this long: a server "
        "that is wedged, not busy.",
    )
    data_dir: Path | None = Field(None, description="Persist committed versions and ef residuals here.")
    # ---- the export
    format: str = Field("bf16", description="Served format.", json_schema_extra={"choices": list(FORMATS)})
    rounding: str = Field("sr", description="Rounding of the export.", json_schema_extra={"choices": list(ROUNDINGS)})
    seed: int = Field(0, ge=0, lt=1 << 64, description="Seed of the rounding RNG.")
    scaling: str = Field(
        "block",
        description="fp8 scales: per tensor, channel (row) or 128x128 block.",
        json_schema_extra={"choices": list(SCALINGS)},
    )
    fp8_pattern: str = Field(DEFAULT_FP8_PATTERN, description="Regex of the 2-D tensor names served in fp8.")
    device: str = Field(
        "auto", description="Export device: auto (the GPU when one is visible), cpu or cuda (Triton kernels).",
        json_schema_extra={"choices": list(DEVICES)},
    )
    gpu_residual_bytes: int = Field(
        16 << 30, ge=0,
        description="ef residuals kept on the GPU between versions (they are on the host too); 0 keeps none.",
    )
    retain: int = Field(4, ge=1, description="Versions kept per model (besides pinned ones).")
    allow_nonfinite: bool = Field(False, description="Accept masters with NaN/Inf (rejected by default).")
    # ---- limits. gRPC messages are sized to chunks, never to tensors: 1 MiB chunks, up to 4 MiB
    # accepted, plus room for the header of a model with tens of thousands of tensors.
    chunk_bytes: int = Field(1 << 20, ge=4096, le=4 << 20, description="Bytes per gRPC chunk the service sends.")
    max_message_bytes: int = Field(8 << 20, ge=64 << 10, description="Largest gRPC message accepted.")
    max_version_bytes: int = Field(default_factory=half_the_memory, ge=1, description="Master bytes of one version.")
    max_staged_bytes: int = Field(
        default_factory=half_the_memory,
        ge=1,
        description="Served bytes staged in memory by all pushes in progress (with --data-dir: in their files).",
    )
    max_tensors: int = Field(1_000_000, ge=1, description="Tensors of one version.")
    max_tensor_bytes: int = Field(default_factory=half_the_memory, ge=1, description="Master bytes of one tensor.")
    # Beyond these a new stream gets RESOURCE_EXHAUSTED (HTTP 429), not a slow death.
    max_pushes: int = Field(64, ge=1, description="Push streams at once (each rank of a multi-rank push is one).")
    max_models: int = Field(256, ge=1, description="Models this server holds (a push of one more is refused).")
    max_connections: int = Field(
        1000, ge=1, description="Connections held at once on each of the gRPC and HTTP ports; more are closed."
    )
    connect_timeout_s: float = Field(
        10.0,
        gt=0,
        description="Close a connection that has not sent a whole HTTP request head (or finished the gRPC "
        "handshake) this long after it opened or after its last response, or a request body this long after its "
        "head (plus 1 s per MiB of it).",
    )
    max_watches: int = Field(
        250,
        ge=1,
        description="Watch streams at once, gRPC and HTTP (at most half of --max-connections); one more ends the "
        "oldest, whose client resumes after the last version it received.",
    )
    max_body_bytes: int = Field(
        64 << 20,
        ge=4096,
        description="Request bodies (selections, acks) being read at once, in bytes; beyond it HTTP 429.",
    )
    max_pulls: int = Field(1024, ge=1, description="Pulls at once, gRPC and HTTP.")
    max_rss_bytes: int = Field(
        0,
        ge=0,
        description="Anonymous resident memory above which no new push is staged (0: 90% of the memory it may use).",
    )
    client_forget_s: float = Field(
        3600.0,
        gt=0,
        description="How long a client that stopped acking still counts in the staleness metrics (a stuck one keeps "
        "its alert firing until then).",
    )
    push_idle_timeout_s: float = Field(120.0, gt=0, description="Abandon a push that sends nothing this long.")
    push_min_bytes_per_s: float = Field(
        1 << 20,
        gt=0,
        description="Abandon a push stream not done within twice --push-idle-timeout-s plus its bytes at this rate.",
    )
    pull_stall_timeout_s: float = Field(
        120.0, gt=0, description="Drop a pull whose client reads nothing this long, and release its version."
    )
    push_rank_timeout_s: float = Field(
        60.0, gt=0, description="Abandon a multi-rank push whose ranks have not all joined this long after the first."
    )
    # ---- auth and TLS. Tokens per role, comma-separated; none at all: auth is off. They are read
    # from the environment only, never from flags, which any user of the machine can list.
    pull_tokens: SecretStr | None = Field(None, description="Bearer tokens of role pull, comma-separated.")
    push_tokens: SecretStr | None = Field(None, description="Bearer tokens of role push, comma-separated.")
    admin_tokens: SecretStr | None = Field(None, description="Bearer tokens of role admin, comma-separated.")
    auth_file: Path | None = Field(None, description='Tokens per role, JSON {"pull": [...], "push": [...]}.')
    auth_open_paths: str = Field("/healthz,/readyz,/metrics", description="HTTP paths that need no token.")
    tls_cert: Path | None = Field(None, description="PEM certificate chain (with --tls-key: TLS on both ports).")
    tls_key: Path | None = Field(None, description="PEM private key.")
    # ---- scale-out
    redis_url: str | None = Field(
        None, description="Redis of the registry shared by replicas (redis://host:6379/0); unset: in-process."
    )
    redis_prefix: str = Field("weightsvc", description="Key prefix in Redis (deployments sharing it keep apart).")
    replica_id: str = Field("", description="This replica's stable name, e.g. a pod name (default HOST-GRPCPORT).")
    replication: int = Field(
        2, ge=1, le=8, description="Replicas that hold each tensor (capped by their number): one may go down at a time."
    )
    advertise_host: str = Field(
        "", description="The host clients reach this replica by (default: --host, or the hostname on 0.0.0.0)."
    )
    relay_from: str | None = Field(
        None, description="Mirror this upstream weightsvc (gRPC HOST:PORT) or object store (s3://BUCKET/PREFIX): "
        "a relay, which refuses pushes."
    )
    # ---- object store
    object_store: str | None = Field(
        None,
        description="Write every committed version through to this object store (s3://BUCKET/PREFIX; endpoint, "
        "region and credentials from the AWS_* environment); started with no versions, restore them from it.",
    )
    object_store_required: bool = Field(
        False, description="A commit waits for its upload to the object store, and fails with it (default: queued)."
    )
    full_every: int = Field(
        10, ge=1, description="Write a full version to the object store every this many versions; deltas between."
    )
    object_store_queue: int = Field(
        16, ge=1,
        description="Versions waiting for upload at most; one more drops the oldest waiting (with a warning).",
    )
    # ---- the fabric data plane
    nixl: bool = Field(
        False,
        description="Lend committed versions over NIXL: readers lease a version and READ its registered memory "
        "(the [nixl] extra).",
    )
    nixl_max_lease_s: float = Field(
        300.0, gt=0, description="The longest NIXL lease a reader is given; a reader that dies holds its version "
        "this long at most.",
    )
    max_leases: int = Field(1024, ge=1, description="NIXL leases held at once.")
    nixl_sources: str = Field(
        "", description="Other servers that lend the same versions over NIXL (relays: gRPC HOST:PORT or http(s) "
        "URLs, comma-separated), named in every lease: a reader whose READ fails here moves to them. A relay "
        "names its upstream too.",
    )
    log_level: str = Field("info", description="debug, info, warning or error.")

    @model_validator(mode="after")
    def _tls_pair(self) -> Settings:
        if (self.tls_cert is None) != (self.tls_key is None):
            raise ValueError("--tls-cert and --tls-key go together")
        return self

    @model_validator(mode="after")
    def _required_alone(self) -> Settings:
        if self.object_store_required and self.redis_url and not self.relay_from:
            raise ValueError("--object-store-required is a single server's: sharded replicas (--redis-url) publish a "
                             "version once every owner's part is in, so after it commits")
        return self

    @field_validator("format", "rounding", "scaling", "device")
    @classmethod
    def _choice(cls, v: str, info: ValidationInfo) -> str:
        """One of the field's `choices`."""
        assert info.field_name is not None
        extra = cls.model_fields[info.field_name].json_schema_extra
        assert isinstance(extra, dict) and isinstance(extra["choices"], list)
        return check_choice(info.field_name, v, tuple(map(str, extra["choices"])))

    @property
    def watch_limit(self) -> int:
        """Watch streams at once: well below the connection bound, so watchers never fill it."""
        return max(1, min(self.max_watches, self.max_connections // 2))

    @property
    def rss_high_water(self) -> int:
        return self.max_rss_bytes or int(physical_memory() * 0.9)

    def tokens(self) -> dict[str, str | None]:
        """The bearer tokens of each role as set (comma-separated); the server builds its `Auth`
        from them and `auth_file`."""
        secrets = {"pull": self.pull_tokens, "push": self.push_tokens, "admin": self.admin_tokens}
        return {role: s.get_secret_value() if s else None for role, s in secrets.items()}
