from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class TensorSpec(_message.Message):
    __slots__ = ("name", "shape", "dtype", "part")
    NAME_FIELD_NUMBER: _ClassVar[int]
    SHAPE_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    PART_FIELD_NUMBER: _ClassVar[int]
    name: str
    shape: _containers.RepeatedScalarFieldContainer[int]
    dtype: str
    part: TensorPart
    def __init__(self, name: _Optional[str] = ..., shape: _Optional[_Iterable[int]] = ..., dtype: _Optional[str] = ..., part: _Optional[_Union[TensorPart, _Mapping]] = ...) -> None: ...

class TensorPart(_message.Message):
    __slots__ = ("offset", "count")
    OFFSET_FIELD_NUMBER: _ClassVar[int]
    COUNT_FIELD_NUMBER: _ClassVar[int]
    offset: int
    count: int
    def __init__(self, offset: _Optional[int] = ..., count: _Optional[int] = ...) -> None: ...

class PushHeader(_message.Message):
    __slots__ = ("model", "step", "tensors", "format", "rounding", "rank", "world_size", "owners", "aliases", "tensor_count", "replication", "adapter")
    class AliasesEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: str
        def __init__(self, key: _Optional[str] = ..., value: _Optional[str] = ...) -> None: ...
    MODEL_FIELD_NUMBER: _ClassVar[int]
    STEP_FIELD_NUMBER: _ClassVar[int]
    TENSORS_FIELD_NUMBER: _ClassVar[int]
    FORMAT_FIELD_NUMBER: _ClassVar[int]
    ROUNDING_FIELD_NUMBER: _ClassVar[int]
    RANK_FIELD_NUMBER: _ClassVar[int]
    WORLD_SIZE_FIELD_NUMBER: _ClassVar[int]
    OWNERS_FIELD_NUMBER: _ClassVar[int]
    ALIASES_FIELD_NUMBER: _ClassVar[int]
    TENSOR_COUNT_FIELD_NUMBER: _ClassVar[int]
    REPLICATION_FIELD_NUMBER: _ClassVar[int]
    ADAPTER_FIELD_NUMBER: _ClassVar[int]
    model: str
    step: int
    tensors: _containers.RepeatedCompositeFieldContainer[TensorSpec]
    format: str
    rounding: str
    rank: int
    world_size: int
    owners: _containers.RepeatedScalarFieldContainer[str]
    aliases: _containers.ScalarMap[str, str]
    tensor_count: int
    replication: int
    adapter: Adapter
    def __init__(self, model: _Optional[str] = ..., step: _Optional[int] = ..., tensors: _Optional[_Iterable[_Union[TensorSpec, _Mapping]]] = ..., format: _Optional[str] = ..., rounding: _Optional[str] = ..., rank: _Optional[int] = ..., world_size: _Optional[int] = ..., owners: _Optional[_Iterable[str]] = ..., aliases: _Optional[_Mapping[str, str]] = ..., tensor_count: _Optional[int] = ..., replication: _Optional[int] = ..., adapter: _Optional[_Union[Adapter, _Mapping]] = ...) -> None: ...

class Adapter(_message.Message):
    __slots__ = ("base_model", "base_version", "base_digest", "rank", "alpha", "target_modules")
    BASE_MODEL_FIELD_NUMBER: _ClassVar[int]
    BASE_VERSION_FIELD_NUMBER: _ClassVar[int]
    BASE_DIGEST_FIELD_NUMBER: _ClassVar[int]
    RANK_FIELD_NUMBER: _ClassVar[int]
    ALPHA_FIELD_NUMBER: _ClassVar[int]
    TARGET_MODULES_FIELD_NUMBER: _ClassVar[int]
    base_model: str
    base_version: int
    base_digest: str
    rank: int
    alpha: float
    target_modules: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, base_model: _Optional[str] = ..., base_version: _Optional[int] = ..., base_digest: _Optional[str] = ..., rank: _Optional[int] = ..., alpha: _Optional[float] = ..., target_modules: _Optional[_Iterable[str]] = ...) -> None: ...

class Chunk(_message.Message):
    __slots__ = ("tensor", "offset", "data")
    TENSOR_FIELD_NUMBER: _ClassVar[int]
    OFFSET_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    tensor: str
    offset: int
    data: bytes
    def __init__(self, tensor: _Optional[str] = ..., offset: _Optional[int] = ..., data: _Optional[bytes] = ...) -> None: ...

class PushCommit(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class PushRequest(_message.Message):
    __slots__ = ("header", "chunk", "commit", "tensors")
    HEADER_FIELD_NUMBER: _ClassVar[int]
    CHUNK_FIELD_NUMBER: _ClassVar[int]
    COMMIT_FIELD_NUMBER: _ClassVar[int]
    TENSORS_FIELD_NUMBER: _ClassVar[int]
    header: PushHeader
    chunk: Chunk
    commit: PushCommit
    tensors: PushTensors
    def __init__(self, header: _Optional[_Union[PushHeader, _Mapping]] = ..., chunk: _Optional[_Union[Chunk, _Mapping]] = ..., commit: _Optional[_Union[PushCommit, _Mapping]] = ..., tensors: _Optional[_Union[PushTensors, _Mapping]] = ...) -> None: ...

class PushTensors(_message.Message):
    __slots__ = ("tensors",)
    TENSORS_FIELD_NUMBER: _ClassVar[int]
    tensors: _containers.RepeatedCompositeFieldContainer[TensorSpec]
    def __init__(self, tensors: _Optional[_Iterable[_Union[TensorSpec, _Mapping]]] = ...) -> None: ...

class PushResponse(_message.Message):
    __slots__ = ("version", "created")
    VERSION_FIELD_NUMBER: _ClassVar[int]
    CREATED_FIELD_NUMBER: _ClassVar[int]
    version: VersionInfo
    created: bool
    def __init__(self, version: _Optional[_Union[VersionInfo, _Mapping]] = ..., created: _Optional[bool] = ...) -> None: ...

class ServedTensor(_message.Message):
    __slots__ = ("name", "shape", "dtype", "offset", "nbytes", "checksum", "slice")
    NAME_FIELD_NUMBER: _ClassVar[int]
    SHAPE_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    OFFSET_FIELD_NUMBER: _ClassVar[int]
    NBYTES_FIELD_NUMBER: _ClassVar[int]
    CHECKSUM_FIELD_NUMBER: _ClassVar[int]
    SLICE_FIELD_NUMBER: _ClassVar[int]
    name: str
    shape: _containers.RepeatedScalarFieldContainer[int]
    dtype: str
    offset: int
    nbytes: int
    checksum: str
    slice: TensorSlice
    def __init__(self, name: _Optional[str] = ..., shape: _Optional[_Iterable[int]] = ..., dtype: _Optional[str] = ..., offset: _Optional[int] = ..., nbytes: _Optional[int] = ..., checksum: _Optional[str] = ..., slice: _Optional[_Union[TensorSlice, _Mapping]] = ...) -> None: ...

class TensorSlice(_message.Message):
    __slots__ = ("dim", "start", "stop")
    DIM_FIELD_NUMBER: _ClassVar[int]
    START_FIELD_NUMBER: _ClassVar[int]
    STOP_FIELD_NUMBER: _ClassVar[int]
    dim: int
    start: int
    stop: int
    def __init__(self, dim: _Optional[int] = ..., start: _Optional[int] = ..., stop: _Optional[int] = ...) -> None: ...

class TensorSelect(_message.Message):
    __slots__ = ("tensor", "slice")
    TENSOR_FIELD_NUMBER: _ClassVar[int]
    SLICE_FIELD_NUMBER: _ClassVar[int]
    tensor: str
    slice: TensorSlice
    def __init__(self, tensor: _Optional[str] = ..., slice: _Optional[_Union[TensorSlice, _Mapping]] = ...) -> None: ...

class Manifest(_message.Message):
    __slots__ = ("model", "version", "format", "rounding", "seed", "committed_unix", "data_bytes", "master_digest", "tensors", "scaling", "lag", "parts", "aliases", "tensor_count", "adapter")
    class AliasesEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: str
        def __init__(self, key: _Optional[str] = ..., value: _Optional[str] = ...) -> None: ...
    MODEL_FIELD_NUMBER: _ClassVar[int]
    VERSION_FIELD_NUMBER: _ClassVar[int]
    FORMAT_FIELD_NUMBER: _ClassVar[int]
    ROUNDING_FIELD_NUMBER: _ClassVar[int]
    SEED_FIELD_NUMBER: _ClassVar[int]
    COMMITTED_UNIX_FIELD_NUMBER: _ClassVar[int]
    DATA_BYTES_FIELD_NUMBER: _ClassVar[int]
    MASTER_DIGEST_FIELD_NUMBER: _ClassVar[int]
    TENSORS_FIELD_NUMBER: _ClassVar[int]
    SCALING_FIELD_NUMBER: _ClassVar[int]
    LAG_FIELD_NUMBER: _ClassVar[int]
    PARTS_FIELD_NUMBER: _ClassVar[int]
    ALIASES_FIELD_NUMBER: _ClassVar[int]
    TENSOR_COUNT_FIELD_NUMBER: _ClassVar[int]
    ADAPTER_FIELD_NUMBER: _ClassVar[int]
    model: str
    version: int
    format: str
    rounding: str
    seed: int
    committed_unix: float
    data_bytes: int
    master_digest: str
    tensors: _containers.RepeatedCompositeFieldContainer[ServedTensor]
    scaling: str
    lag: LagMetrics
    parts: _containers.RepeatedCompositeFieldContainer[ManifestPart]
    aliases: _containers.ScalarMap[str, str]
    tensor_count: int
    adapter: Adapter
    def __init__(self, model: _Optional[str] = ..., version: _Optional[int] = ..., format: _Optional[str] = ..., rounding: _Optional[str] = ..., seed: _Optional[int] = ..., committed_unix: _Optional[float] = ..., data_bytes: _Optional[int] = ..., master_digest: _Optional[str] = ..., tensors: _Optional[_Iterable[_Union[ServedTensor, _Mapping]]] = ..., scaling: _Optional[str] = ..., lag: _Optional[_Union[LagMetrics, _Mapping]] = ..., parts: _Optional[_Iterable[_Union[ManifestPart, _Mapping]]] = ..., aliases: _Optional[_Mapping[str, str]] = ..., tensor_count: _Optional[int] = ..., adapter: _Optional[_Union[Adapter, _Mapping]] = ...) -> None: ...

class ManifestTensors(_message.Message):
    __slots__ = ("tensors",)
    TENSORS_FIELD_NUMBER: _ClassVar[int]
    tensors: _containers.RepeatedCompositeFieldContainer[ServedTensor]
    def __init__(self, tensors: _Optional[_Iterable[_Union[ServedTensor, _Mapping]]] = ...) -> None: ...

class ManifestPart(_message.Message):
    __slots__ = ("owner", "offset", "nbytes", "holders")
    OWNER_FIELD_NUMBER: _ClassVar[int]
    OFFSET_FIELD_NUMBER: _ClassVar[int]
    NBYTES_FIELD_NUMBER: _ClassVar[int]
    HOLDERS_FIELD_NUMBER: _ClassVar[int]
    owner: str
    offset: int
    nbytes: int
    holders: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, owner: _Optional[str] = ..., offset: _Optional[int] = ..., nbytes: _Optional[int] = ..., holders: _Optional[_Iterable[str]] = ...) -> None: ...

class LagMetrics(_message.Message):
    __slots__ = ("churn", "update_visibility", "lag_steps", "relative_error", "saturated_elements", "sampled_elements", "exact")
    CHURN_FIELD_NUMBER: _ClassVar[int]
    UPDATE_VISIBILITY_FIELD_NUMBER: _ClassVar[int]
    LAG_STEPS_FIELD_NUMBER: _ClassVar[int]
    RELATIVE_ERROR_FIELD_NUMBER: _ClassVar[int]
    SATURATED_ELEMENTS_FIELD_NUMBER: _ClassVar[int]
    SAMPLED_ELEMENTS_FIELD_NUMBER: _ClassVar[int]
    EXACT_FIELD_NUMBER: _ClassVar[int]
    churn: float
    update_visibility: float
    lag_steps: int
    relative_error: float
    saturated_elements: int
    sampled_elements: int
    exact: bool
    def __init__(self, churn: _Optional[float] = ..., update_visibility: _Optional[float] = ..., lag_steps: _Optional[int] = ..., relative_error: _Optional[float] = ..., saturated_elements: _Optional[int] = ..., sampled_elements: _Optional[int] = ..., exact: _Optional[bool] = ...) -> None: ...

class VersionInfo(_message.Message):
    __slots__ = ("model", "version", "format", "rounding", "committed_unix", "tensor_count", "data_bytes", "lag", "mismatch", "mismatch_step")
    MODEL_FIELD_NUMBER: _ClassVar[int]
    VERSION_FIELD_NUMBER: _ClassVar[int]
    FORMAT_FIELD_NUMBER: _ClassVar[int]
    ROUNDING_FIELD_NUMBER: _ClassVar[int]
    COMMITTED_UNIX_FIELD_NUMBER: _ClassVar[int]
    TENSOR_COUNT_FIELD_NUMBER: _ClassVar[int]
    DATA_BYTES_FIELD_NUMBER: _ClassVar[int]
    LAG_FIELD_NUMBER: _ClassVar[int]
    MISMATCH_FIELD_NUMBER: _ClassVar[int]
    MISMATCH_STEP_FIELD_NUMBER: _ClassVar[int]
    model: str
    version: int
    format: str
    rounding: str
    committed_unix: float
    tensor_count: int
    data_bytes: int
    lag: LagMetrics
    mismatch: RolloutMismatch
    mismatch_step: int
    def __init__(self, model: _Optional[str] = ..., version: _Optional[int] = ..., format: _Optional[str] = ..., rounding: _Optional[str] = ..., committed_unix: _Optional[float] = ..., tensor_count: _Optional[int] = ..., data_bytes: _Optional[int] = ..., lag: _Optional[_Union[LagMetrics, _Mapping]] = ..., mismatch: _Optional[_Union[RolloutMismatch, _Mapping]] = ..., mismatch_step: _Optional[int] = ...) -> None: ...

class PullRequest(_message.Message):
    __slots__ = ("model", "version", "offset", "base", "select")
    MODEL_FIELD_NUMBER: _ClassVar[int]
    VERSION_FIELD_NUMBER: _ClassVar[int]
    OFFSET_FIELD_NUMBER: _ClassVar[int]
    BASE_FIELD_NUMBER: _ClassVar[int]
    SELECT_FIELD_NUMBER: _ClassVar[int]
    model: str
    version: str
    offset: int
    base: str
    select: _containers.RepeatedCompositeFieldContainer[TensorSelect]
    def __init__(self, model: _Optional[str] = ..., version: _Optional[str] = ..., offset: _Optional[int] = ..., base: _Optional[str] = ..., select: _Optional[_Iterable[_Union[TensorSelect, _Mapping]]] = ...) -> None: ...

class Delta(_message.Message):
    __slots__ = ("base_version", "delta_bytes")
    BASE_VERSION_FIELD_NUMBER: _ClassVar[int]
    DELTA_BYTES_FIELD_NUMBER: _ClassVar[int]
    base_version: int
    delta_bytes: int
    def __init__(self, base_version: _Optional[int] = ..., delta_bytes: _Optional[int] = ...) -> None: ...

class PullResponse(_message.Message):
    __slots__ = ("manifest", "chunk", "delta", "manifest_tensors")
    MANIFEST_FIELD_NUMBER: _ClassVar[int]
    CHUNK_FIELD_NUMBER: _ClassVar[int]
    DELTA_FIELD_NUMBER: _ClassVar[int]
    MANIFEST_TENSORS_FIELD_NUMBER: _ClassVar[int]
    manifest: Manifest
    chunk: Chunk
    delta: Delta
    manifest_tensors: ManifestTensors
    def __init__(self, manifest: _Optional[_Union[Manifest, _Mapping]] = ..., chunk: _Optional[_Union[Chunk, _Mapping]] = ..., delta: _Optional[_Union[Delta, _Mapping]] = ..., manifest_tensors: _Optional[_Union[ManifestTensors, _Mapping]] = ...) -> None: ...

class ListModelsRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class ModelSummary(_message.Message):
    __slots__ = ("model", "latest_version", "versions")
    MODEL_FIELD_NUMBER: _ClassVar[int]
    LATEST_VERSION_FIELD_NUMBER: _ClassVar[int]
    VERSIONS_FIELD_NUMBER: _ClassVar[int]
    model: str
    latest_version: int
    versions: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, model: _Optional[str] = ..., latest_version: _Optional[int] = ..., versions: _Optional[_Iterable[int]] = ...) -> None: ...

class DamagedFile(_message.Message):
    __slots__ = ("model", "file", "reason")
    MODEL_FIELD_NUMBER: _ClassVar[int]
    FILE_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    model: str
    file: str
    reason: str
    def __init__(self, model: _Optional[str] = ..., file: _Optional[str] = ..., reason: _Optional[str] = ...) -> None: ...

class ListModelsResponse(_message.Message):
    __slots__ = ("models", "damaged_files")
    MODELS_FIELD_NUMBER: _ClassVar[int]
    DAMAGED_FILES_FIELD_NUMBER: _ClassVar[int]
    models: _containers.RepeatedCompositeFieldContainer[ModelSummary]
    damaged_files: _containers.RepeatedCompositeFieldContainer[DamagedFile]
    def __init__(self, models: _Optional[_Iterable[_Union[ModelSummary, _Mapping]]] = ..., damaged_files: _Optional[_Iterable[_Union[DamagedFile, _Mapping]]] = ...) -> None: ...

class ListVersionsRequest(_message.Message):
    __slots__ = ("model",)
    MODEL_FIELD_NUMBER: _ClassVar[int]
    model: str
    def __init__(self, model: _Optional[str] = ...) -> None: ...

class ListVersionsResponse(_message.Message):
    __slots__ = ("versions", "damaged_files")
    VERSIONS_FIELD_NUMBER: _ClassVar[int]
    DAMAGED_FILES_FIELD_NUMBER: _ClassVar[int]
    versions: _containers.RepeatedCompositeFieldContainer[VersionInfo]
    damaged_files: _containers.RepeatedCompositeFieldContainer[DamagedFile]
    def __init__(self, versions: _Optional[_Iterable[_Union[VersionInfo, _Mapping]]] = ..., damaged_files: _Optional[_Iterable[_Union[DamagedFile, _Mapping]]] = ...) -> None: ...

class GetManifestRequest(_message.Message):
    __slots__ = ("model", "version", "tensors_from")
    MODEL_FIELD_NUMBER: _ClassVar[int]
    VERSION_FIELD_NUMBER: _ClassVar[int]
    TENSORS_FROM_FIELD_NUMBER: _ClassVar[int]
    model: str
    version: str
    tensors_from: int
    def __init__(self, model: _Optional[str] = ..., version: _Optional[str] = ..., tensors_from: _Optional[int] = ...) -> None: ...

class WatchRequest(_message.Message):
    __slots__ = ("model", "after_version")
    MODEL_FIELD_NUMBER: _ClassVar[int]
    AFTER_VERSION_FIELD_NUMBER: _ClassVar[int]
    model: str
    after_version: int
    def __init__(self, model: _Optional[str] = ..., after_version: _Optional[int] = ...) -> None: ...

class VersionEvent(_message.Message):
    __slots__ = ("version",)
    VERSION_FIELD_NUMBER: _ClassVar[int]
    version: VersionInfo
    def __init__(self, version: _Optional[_Union[VersionInfo, _Mapping]] = ...) -> None: ...

class AckRequest(_message.Message):
    __slots__ = ("model", "version", "client_id")
    MODEL_FIELD_NUMBER: _ClassVar[int]
    VERSION_FIELD_NUMBER: _ClassVar[int]
    CLIENT_ID_FIELD_NUMBER: _ClassVar[int]
    model: str
    version: int
    client_id: str
    def __init__(self, model: _Optional[str] = ..., version: _Optional[int] = ..., client_id: _Optional[str] = ...) -> None: ...

class AckResponse(_message.Message):
    __slots__ = ("latest_version",)
    LATEST_VERSION_FIELD_NUMBER: _ClassVar[int]
    latest_version: int
    def __init__(self, latest_version: _Optional[int] = ...) -> None: ...

class ListClientsRequest(_message.Message):
    __slots__ = ("model",)
    MODEL_FIELD_NUMBER: _ClassVar[int]
    model: str
    def __init__(self, model: _Optional[str] = ...) -> None: ...

class ClientStatus(_message.Message):
    __slots__ = ("client_id", "version", "lag_versions", "last_seen_unix", "connected")
    CLIENT_ID_FIELD_NUMBER: _ClassVar[int]
    VERSION_FIELD_NUMBER: _ClassVar[int]
    LAG_VERSIONS_FIELD_NUMBER: _ClassVar[int]
    LAST_SEEN_UNIX_FIELD_NUMBER: _ClassVar[int]
    CONNECTED_FIELD_NUMBER: _ClassVar[int]
    client_id: str
    version: int
    lag_versions: int
    last_seen_unix: float
    connected: bool
    def __init__(self, client_id: _Optional[str] = ..., version: _Optional[int] = ..., lag_versions: _Optional[int] = ..., last_seen_unix: _Optional[float] = ..., connected: _Optional[bool] = ...) -> None: ...

class ListClientsResponse(_message.Message):
    __slots__ = ("model", "latest_version", "clients")
    MODEL_FIELD_NUMBER: _ClassVar[int]
    LATEST_VERSION_FIELD_NUMBER: _ClassVar[int]
    CLIENTS_FIELD_NUMBER: _ClassVar[int]
    model: str
    latest_version: int
    clients: _containers.RepeatedCompositeFieldContainer[ClientStatus]
    def __init__(self, model: _Optional[str] = ..., latest_version: _Optional[int] = ..., clients: _Optional[_Iterable[_Union[ClientStatus, _Mapping]]] = ...) -> None: ...

class GetTopologyRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class Replica(_message.Message):
    __slots__ = ("id", "grpc", "http")
    ID_FIELD_NUMBER: _ClassVar[int]
    GRPC_FIELD_NUMBER: _ClassVar[int]
    HTTP_FIELD_NUMBER: _ClassVar[int]
    id: str
    grpc: str
    http: str
    def __init__(self, id: _Optional[str] = ..., grpc: _Optional[str] = ..., http: _Optional[str] = ...) -> None: ...

class Topology(_message.Message):
    __slots__ = ("replicas", "hashing", "replication")
    REPLICAS_FIELD_NUMBER: _ClassVar[int]
    HASHING_FIELD_NUMBER: _ClassVar[int]
    REPLICATION_FIELD_NUMBER: _ClassVar[int]
    replicas: _containers.RepeatedCompositeFieldContainer[Replica]
    hashing: str
    replication: int
    def __init__(self, replicas: _Optional[_Iterable[_Union[Replica, _Mapping]]] = ..., hashing: _Optional[str] = ..., replication: _Optional[int] = ...) -> None: ...

class RolloutMismatch(_message.Message):
    __slots__ = ("tokens", "mean_abs_logp_delta", "k3_kl", "outside_band", "band_low", "band_high")
    TOKENS_FIELD_NUMBER: _ClassVar[int]
    MEAN_ABS_LOGP_DELTA_FIELD_NUMBER: _ClassVar[int]
    K3_KL_FIELD_NUMBER: _ClassVar[int]
    OUTSIDE_BAND_FIELD_NUMBER: _ClassVar[int]
    BAND_LOW_FIELD_NUMBER: _ClassVar[int]
    BAND_HIGH_FIELD_NUMBER: _ClassVar[int]
    tokens: int
    mean_abs_logp_delta: float
    k3_kl: float
    outside_band: float
    band_low: float
    band_high: float
    def __init__(self, tokens: _Optional[int] = ..., mean_abs_logp_delta: _Optional[float] = ..., k3_kl: _Optional[float] = ..., outside_band: _Optional[float] = ..., band_low: _Optional[float] = ..., band_high: _Optional[float] = ...) -> None: ...

class ReportMismatchRequest(_message.Message):
    __slots__ = ("model", "versions", "step")
    class VersionsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: int
        value: RolloutMismatch
        def __init__(self, key: _Optional[int] = ..., value: _Optional[_Union[RolloutMismatch, _Mapping]] = ...) -> None: ...
    MODEL_FIELD_NUMBER: _ClassVar[int]
    VERSIONS_FIELD_NUMBER: _ClassVar[int]
    STEP_FIELD_NUMBER: _ClassVar[int]
    model: str
    versions: _containers.MessageMap[int, RolloutMismatch]
    step: int
    def __init__(self, model: _Optional[str] = ..., versions: _Optional[_Mapping[int, RolloutMismatch]] = ..., step: _Optional[int] = ...) -> None: ...

class ReportMismatchResponse(_message.Message):
    __slots__ = ("versions",)
    class VersionsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: int
        value: RolloutMismatch
        def __init__(self, key: _Optional[int] = ..., value: _Optional[_Union[RolloutMismatch, _Mapping]] = ...) -> None: ...
    VERSIONS_FIELD_NUMBER: _ClassVar[int]
    versions: _containers.MessageMap[int, RolloutMismatch]
    def __init__(self, versions: _Optional[_Mapping[int, RolloutMismatch]] = ...) -> None: ...

class LeaseVersionRequest(_message.Message):
    __slots__ = ("model", "version", "select", "lease_s", "base", "lease_id", "tensors_from")
    MODEL_FIELD_NUMBER: _ClassVar[int]
    VERSION_FIELD_NUMBER: _ClassVar[int]
    SELECT_FIELD_NUMBER: _ClassVar[int]
    LEASE_S_FIELD_NUMBER: _ClassVar[int]
    BASE_FIELD_NUMBER: _ClassVar[int]
    LEASE_ID_FIELD_NUMBER: _ClassVar[int]
    TENSORS_FROM_FIELD_NUMBER: _ClassVar[int]
    model: str
    version: str
    select: _containers.RepeatedCompositeFieldContainer[TensorSelect]
    lease_s: float
    base: str
    lease_id: str
    tensors_from: int
    def __init__(self, model: _Optional[str] = ..., version: _Optional[str] = ..., select: _Optional[_Iterable[_Union[TensorSelect, _Mapping]]] = ..., lease_s: _Optional[float] = ..., base: _Optional[str] = ..., lease_id: _Optional[str] = ..., tensors_from: _Optional[int] = ...) -> None: ...

class MemoryRange(_message.Message):
    __slots__ = ("addr", "nbytes", "device")
    ADDR_FIELD_NUMBER: _ClassVar[int]
    NBYTES_FIELD_NUMBER: _ClassVar[int]
    DEVICE_FIELD_NUMBER: _ClassVar[int]
    addr: int
    nbytes: int
    device: int
    def __init__(self, addr: _Optional[int] = ..., nbytes: _Optional[int] = ..., device: _Optional[int] = ...) -> None: ...

class TensorRanges(_message.Message):
    __slots__ = ("tensor", "ranges")
    TENSOR_FIELD_NUMBER: _ClassVar[int]
    RANGES_FIELD_NUMBER: _ClassVar[int]
    tensor: str
    ranges: _containers.RepeatedCompositeFieldContainer[MemoryRange]
    def __init__(self, tensor: _Optional[str] = ..., ranges: _Optional[_Iterable[_Union[MemoryRange, _Mapping]]] = ...) -> None: ...

class VersionLease(_message.Message):
    __slots__ = ("lease_id", "manifest", "agent", "memory", "lease_s", "tensors", "base_version", "delta", "sources")
    LEASE_ID_FIELD_NUMBER: _ClassVar[int]
    MANIFEST_FIELD_NUMBER: _ClassVar[int]
    AGENT_FIELD_NUMBER: _ClassVar[int]
    MEMORY_FIELD_NUMBER: _ClassVar[int]
    LEASE_S_FIELD_NUMBER: _ClassVar[int]
    TENSORS_FIELD_NUMBER: _ClassVar[int]
    BASE_VERSION_FIELD_NUMBER: _ClassVar[int]
    DELTA_FIELD_NUMBER: _ClassVar[int]
    SOURCES_FIELD_NUMBER: _ClassVar[int]
    lease_id: str
    manifest: Manifest
    agent: bytes
    memory: str
    lease_s: float
    tensors: _containers.RepeatedCompositeFieldContainer[TensorRanges]
    base_version: int
    delta: _containers.RepeatedCompositeFieldContainer[MemoryRange]
    sources: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, lease_id: _Optional[str] = ..., manifest: _Optional[_Union[Manifest, _Mapping]] = ..., agent: _Optional[bytes] = ..., memory: _Optional[str] = ..., lease_s: _Optional[float] = ..., tensors: _Optional[_Iterable[_Union[TensorRanges, _Mapping]]] = ..., base_version: _Optional[int] = ..., delta: _Optional[_Iterable[_Union[MemoryRange, _Mapping]]] = ..., sources: _Optional[_Iterable[str]] = ...) -> None: ...

class ReleaseLeaseRequest(_message.Message):
    __slots__ = ("lease_id",)
    LEASE_ID_FIELD_NUMBER: _ClassVar[int]
    lease_id: str
    def __init__(self, lease_id: _Optional[str] = ...) -> None: ...

class ReleaseLeaseResponse(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class ExportSpec(_message.Message):
    __slots__ = ("format", "rounding", "seed", "scaling", "fp8_pattern")
    FORMAT_FIELD_NUMBER: _ClassVar[int]
    ROUNDING_FIELD_NUMBER: _ClassVar[int]
    SEED_FIELD_NUMBER: _ClassVar[int]
    SCALING_FIELD_NUMBER: _ClassVar[int]
    FP8_PATTERN_FIELD_NUMBER: _ClassVar[int]
    format: str
    rounding: str
    seed: int
    scaling: str
    fp8_pattern: str
    def __init__(self, format: _Optional[str] = ..., rounding: _Optional[str] = ..., seed: _Optional[int] = ..., scaling: _Optional[str] = ..., fp8_pattern: _Optional[str] = ...) -> None: ...

class PublishedTensor(_message.Message):
    __slots__ = ("name", "shape", "dtype", "part", "checksum", "ranges")
    NAME_FIELD_NUMBER: _ClassVar[int]
    SHAPE_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    PART_FIELD_NUMBER: _ClassVar[int]
    CHECKSUM_FIELD_NUMBER: _ClassVar[int]
    RANGES_FIELD_NUMBER: _ClassVar[int]
    name: str
    shape: _containers.RepeatedScalarFieldContainer[int]
    dtype: str
    part: TensorPart
    checksum: str
    ranges: _containers.RepeatedCompositeFieldContainer[MemoryRange]
    def __init__(self, name: _Optional[str] = ..., shape: _Optional[_Iterable[int]] = ..., dtype: _Optional[str] = ..., part: _Optional[_Union[TensorPart, _Mapping]] = ..., checksum: _Optional[str] = ..., ranges: _Optional[_Iterable[_Union[MemoryRange, _Mapping]]] = ...) -> None: ...

class PublishRequest(_message.Message):
    __slots__ = ("model", "step", "rank", "world_size", "spec", "agent", "memory", "tensors", "master_digest", "aliases", "lag")
    class AliasesEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: str
        def __init__(self, key: _Optional[str] = ..., value: _Optional[str] = ...) -> None: ...
    MODEL_FIELD_NUMBER: _ClassVar[int]
    STEP_FIELD_NUMBER: _ClassVar[int]
    RANK_FIELD_NUMBER: _ClassVar[int]
    WORLD_SIZE_FIELD_NUMBER: _ClassVar[int]
    SPEC_FIELD_NUMBER: _ClassVar[int]
    AGENT_FIELD_NUMBER: _ClassVar[int]
    MEMORY_FIELD_NUMBER: _ClassVar[int]
    TENSORS_FIELD_NUMBER: _ClassVar[int]
    MASTER_DIGEST_FIELD_NUMBER: _ClassVar[int]
    ALIASES_FIELD_NUMBER: _ClassVar[int]
    LAG_FIELD_NUMBER: _ClassVar[int]
    model: str
    step: int
    rank: int
    world_size: int
    spec: ExportSpec
    agent: bytes
    memory: str
    tensors: _containers.RepeatedCompositeFieldContainer[PublishedTensor]
    master_digest: str
    aliases: _containers.ScalarMap[str, str]
    lag: LagSums
    def __init__(self, model: _Optional[str] = ..., step: _Optional[int] = ..., rank: _Optional[int] = ..., world_size: _Optional[int] = ..., spec: _Optional[_Union[ExportSpec, _Mapping]] = ..., agent: _Optional[bytes] = ..., memory: _Optional[str] = ..., tensors: _Optional[_Iterable[_Union[PublishedTensor, _Mapping]]] = ..., master_digest: _Optional[str] = ..., aliases: _Optional[_Mapping[str, str]] = ..., lag: _Optional[_Union[LagSums, _Mapping]] = ...) -> None: ...

class LagSums(_message.Message):
    __slots__ = ("reference", "previous", "distance_sq", "progress", "master_sq", "error_sq", "changed", "compared", "windows", "saturated_elements", "sampled_elements", "exact")
    REFERENCE_FIELD_NUMBER: _ClassVar[int]
    PREVIOUS_FIELD_NUMBER: _ClassVar[int]
    DISTANCE_SQ_FIELD_NUMBER: _ClassVar[int]
    PROGRESS_FIELD_NUMBER: _ClassVar[int]
    MASTER_SQ_FIELD_NUMBER: _ClassVar[int]
    ERROR_SQ_FIELD_NUMBER: _ClassVar[int]
    CHANGED_FIELD_NUMBER: _ClassVar[int]
    COMPARED_FIELD_NUMBER: _ClassVar[int]
    WINDOWS_FIELD_NUMBER: _ClassVar[int]
    SATURATED_ELEMENTS_FIELD_NUMBER: _ClassVar[int]
    SAMPLED_ELEMENTS_FIELD_NUMBER: _ClassVar[int]
    EXACT_FIELD_NUMBER: _ClassVar[int]
    reference: int
    previous: int
    distance_sq: float
    progress: float
    master_sq: float
    error_sq: float
    changed: int
    compared: int
    windows: _containers.RepeatedCompositeFieldContainer[VisibilityWindow]
    saturated_elements: int
    sampled_elements: int
    exact: bool
    def __init__(self, reference: _Optional[int] = ..., previous: _Optional[int] = ..., distance_sq: _Optional[float] = ..., progress: _Optional[float] = ..., master_sq: _Optional[float] = ..., error_sq: _Optional[float] = ..., changed: _Optional[int] = ..., compared: _Optional[int] = ..., windows: _Optional[_Iterable[_Union[VisibilityWindow, _Mapping]]] = ..., saturated_elements: _Optional[int] = ..., sampled_elements: _Optional[int] = ..., exact: _Optional[bool] = ...) -> None: ...

class VisibilityWindow(_message.Message):
    __slots__ = ("start", "served_step", "master_step", "noise", "noise_sq")
    START_FIELD_NUMBER: _ClassVar[int]
    SERVED_STEP_FIELD_NUMBER: _ClassVar[int]
    MASTER_STEP_FIELD_NUMBER: _ClassVar[int]
    NOISE_FIELD_NUMBER: _ClassVar[int]
    NOISE_SQ_FIELD_NUMBER: _ClassVar[int]
    start: int
    served_step: float
    master_step: float
    noise: float
    noise_sq: float
    def __init__(self, start: _Optional[int] = ..., served_step: _Optional[float] = ..., master_step: _Optional[float] = ..., noise: _Optional[float] = ..., noise_sq: _Optional[float] = ...) -> None: ...
