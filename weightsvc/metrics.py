"""Prometheus metrics: one registry per service, base units, bounded labels.

Labels are limited to model, format, rounding, transport and a fixed set of reasons; never a
client id or a tensor name.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable, Iterable

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import GaugeMetricFamily, HistogramMetricFamily, Metric
from prometheus_client.registry import Collector

from weightsvc.protocol.clients import ClientStatus
from weightsvc.protocol.lag import LagMetrics
from weightsvc.protocol.mismatch import RolloutMismatch

# Rejected pushes are labelled by their error's `reason` (`errors.WeightsvcError.reason`); these
# have a series from the start, at zero until a push is rejected for them.
REJECT_REASONS = (
    "invalid_header",
    "bad_chunk",
    "incomplete",
    "nonfinite",
    "step_not_above_latest",
    "content_conflict",
    "too_large",
    "aborted",
    "too_many",
    "relay",
    "internal",
    "registry",
    "other",
)

_SYNC_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300)
_LAG_BUCKETS = (0, 1, 2, 4, 8, 16, 32, 64)
_EXPORT_BUCKETS = (0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30)
_LOOP_LAG_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60)
# Why a connection was closed by the server (`connections_dropped`).
DROP_REASONS = (
    ("grpc", "unauthenticated"),
    ("grpc", "over_limit"),
    ("http", "over_limit"),
    ("http", "head_timeout"),
    ("http", "body_timeout"),
    ("http", "head_too_large"),
)
# What a relay was doing when something failed (it logs the failure and retries).
RELAY_STAGES = ("discover", "follow", "mirror")
# Why a relay refused a version of its upstream (it retries it): its manifest or bytes are not what
# they must be (invalid), or it is over the relay's own limits (too_large, too_many models).
RELAY_REFUSALS = ("invalid", "too_large", "too_many")
# Why a relay does not follow a model its upstream lists: no model can have its name, or the relay
# follows --max-models already.
RELAY_UNFOLLOWED = ("invalid_name", "max_models")
# Why a NIXL lease failed its reader: it expired before the reader said it was done (a reader that
# died, or one slower than its lease), or the server refused it (too many leases, a lease unknown).
NIXL_FAILURES = ("expired", "too_many", "unknown_lease", "register")


class Metrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        r = self.registry
        self.latest_version = Gauge(
            "weightsvc_latest_version",
            "Latest committed version (the learner's step) per model",
            ["model"],
            registry=r,
        )
        self.damaged_files = Gauge(
            "weightsvc_damaged_files",
            "Versions found damaged at start-up and set aside: files of the data dir (moved under <data dir>/damaged) "
            "and versions of the object store (left where they are)", registry=r,
        )
        self.retained_versions = Gauge(
            "weightsvc_retained_versions", "Committed versions held per model", ["model"], registry=r
        )
        self.retained_bytes = Gauge(
            "weightsvc_retained_bytes", "Served bytes held for committed versions", ["model"], registry=r
        )
        self.versions_committed = Counter("weightsvc_versions_committed", "Versions committed", ["model"], registry=r)
        self.push_bytes = Counter("weightsvc_push_bytes", "Master bytes received from learners", ["model"], registry=r)
        self.pull_bytes = Counter(
            "weightsvc_pull_bytes", "Served bytes sent to pullers", ["model", "transport"], registry=r
        )
        self.pushes_rejected = Counter(
            "weightsvc_pushes_rejected", "Pushes that did not commit, by reason", ["reason"], registry=r
        )
        self.pushes_in_flight = Gauge("weightsvc_pushes_in_flight", "Pushes being received or exported", registry=r)
        self.publish_bytes = Counter("weightsvc_publish_bytes", "Served bytes READ from learner ranks' publishes",
                                     ["model"], registry=r)
        self.publishes_in_flight = Gauge("weightsvc_publishes_in_flight",
                                         "Learner ranks' publish calls waiting for their version", registry=r)
        self.staged_bytes = Gauge("weightsvc_staged_bytes", "Bytes held by pushes that have not committed", registry=r)
        self.gpu_staged_bytes = Gauge(
            "weightsvc_gpu_staged_bytes", "Bytes the GPU holds for exports in progress (--device cuda)", registry=r
        )
        self.gpu_residual_bytes = Gauge(
            "weightsvc_gpu_residual_bytes",
            "Bytes of ef residuals kept on the GPU between versions (--device cuda, --gpu-residual-bytes)",
            registry=r,
        )
        # Where each ef chunk's residual came from on the GPU: "device" (kept there since the last
        # version) or "host" (copied in: the first version, or one the bound or a restart left out).
        self.gpu_residual_chunks = Counter(
            "weightsvc_gpu_residual_chunks", "ef residual chunks a GPU export read, by where it found them",
            ["source"], registry=r,
        )
        self.pulls_in_flight = Gauge("weightsvc_pulls_in_flight", "Pulls being streamed", ["transport"], registry=r)
        self.watches = Gauge("weightsvc_watches", "Watch streams open, gRPC and HTTP", registry=r)
        self.watches_evicted = Counter(
            "weightsvc_watches_evicted", "Watch streams ended to make room for a newer one (--max-watches)", registry=r
        )
        self.request_body_bytes = Gauge(
            "weightsvc_request_body_bytes", "Bytes of HTTP request bodies being read (--max-body-bytes)", registry=r
        )
        self.connections_dropped = Counter(
            "weightsvc_connections_dropped", "Connections the server closed to protect others, by transport and reason",
            ["transport", "reason"], registry=r,
        )
        self.export_seconds = Histogram(
            "weightsvc_export_seconds",
            "Time the export worker spent on one version (Fair Cast + checksums)",
            ["format", "rounding"],
            buckets=_EXPORT_BUCKETS,
            registry=r,
        )
        lag_labels = ["model", "format", "rounding"]
        self.served_lag_steps = Gauge(
            "weightsvc_served_lag_steps",
            "Steps the served copy lags the learner's masters, at the latest version",
            lag_labels, registry=r,
        )
        self.update_visibility = Gauge(
            "weightsvc_update_visibility_ratio",
            "Share of the learner's recent update that reached the served copy, over the shortest window of "
            "versions that tells it from rounding noise (NaN while none does)",
            lag_labels, registry=r,
        )
        self.served_churn = Gauge(
            "weightsvc_served_churn_ratio", "Share of served elements whose bits changed from the previous version",
            lag_labels, registry=r,
        )
        self.served_relative_error = Gauge(
            "weightsvc_served_relative_error", "||served - master|| / ||master|| at the latest version",
            lag_labels, registry=r,
        )
        self.saturated_elements = Counter(
            "weightsvc_saturated_elements", "Finite master elements clamped to the format's max",
            lag_labels, registry=r,
        )
        # The trainer-rollout mismatch learners report: sums over tokens, which add up across replicas and
        # reports (rate(k3 sum) / rate(tokens) is the fleet's token mean), and the totals of the latest
        # reported version as the registry held them after this replica's last report.
        self.mismatch_tokens = Counter(
            "weightsvc_rollout_mismatch_tokens", "Rollout tokens whose trainer-rollout mismatch learners reported",
            lag_labels, registry=r,
        )
        self.mismatch_k3_kl_sum = Counter(
            "weightsvc_rollout_mismatch_k3_kl_sum",
            "Sum over reported tokens of r - 1 - log r, r = exp(learner - engine logprob) (k3 KL of engine || learner)",
            lag_labels, registry=r,
        )
        self.mismatch_abs_logp_delta_sum = Counter(
            "weightsvc_rollout_mismatch_abs_logp_delta_sum", "Sum over reported tokens of |learner - engine logprob|",
            lag_labels, registry=r,
        )
        self.mismatch_outside_band_tokens = Counter(
            "weightsvc_rollout_mismatch_outside_band_tokens",
            "Reported tokens whose ratio r lies outside the IcePop band", lag_labels, registry=r,
        )
        self.mismatch_k3_kl = Gauge(
            "weightsvc_rollout_mismatch_k3_kl", "Token mean of the k3 KL (engine || learner) of the latest reported "
            "version, over every report of it", lag_labels, registry=r,
        )
        self.mismatch_abs_logp_delta = Gauge(
            "weightsvc_rollout_mismatch_abs_logp_delta", "Token mean of |learner - engine logprob| of the latest "
            "reported version, over every report of it", lag_labels, registry=r,
        )
        self.version_sync_seconds = Histogram(
            "weightsvc_version_sync_seconds", "Seconds from a version's commit to a client's first ack of it",
            ["model"], buckets=_SYNC_BUCKETS, registry=r,
        )
        self.event_loop_lag = Histogram(
            "weightsvc_event_loop_lag_seconds",
            "How late the event loop woke a timer: time it was blocked and could serve nobody",
            buckets=_LOOP_LAG_BUCKETS, registry=r,
        )
        self.gc_pause = Histogram(
            "weightsvc_gc_pause_seconds",
            "Collections of the cyclic garbage collector, by generation: each holds the GIL, and so the event loop",
            ["generation"], buckets=_LOOP_LAG_BUCKETS, registry=r,
        )
        for generation in ("0", "1", "2"):
            self.gc_pause.labels(generation)
        self.relay_failures = Counter(
            "weightsvc_relay_failures", "Failures of a relay following its upstream (each retried), by stage",
            ["stage"], registry=r,
        )
        for stage in RELAY_STAGES:
            self.relay_failures.labels(stage)
        self.relay_refused = Counter(
            "weightsvc_relay_refused", "Versions of its upstream a relay refused (each retried), by reason",
            ["reason"], registry=r,
        )
        for reason in RELAY_REFUSALS:
            self.relay_refused.labels(reason)
        self.relay_followed = Gauge("weightsvc_relay_models_followed", "Models a relay follows", registry=r)
        self.relay_unfollowed = Gauge(
            "weightsvc_relay_models_unfollowed", "Models a relay's upstream lists that it does not follow, by reason",
            ["reason"], registry=r,
        )
        for reason in RELAY_UNFOLLOWED:
            self.relay_unfollowed.labels(reason)
        # The object store (--object-store): what waits for upload, what went, what was given up.
        self.store_queued = Gauge("weightsvc_store_uploads_queued", "Versions waiting for upload to the object store",
                                  registry=r)
        self.store_uploads = Counter("weightsvc_store_uploads", "Versions written to the object store, by kind",
                                     ["kind"], registry=r)
        self.store_bytes = Counter("weightsvc_store_upload_bytes", "Bytes written to the object store, by kind",
                                   ["kind"], registry=r)
        for kind in ("full", "delta"):
            self.store_uploads.labels(kind)
            self.store_bytes.labels(kind)
        self.store_failures = Counter("weightsvc_store_upload_failures",
                                      "Uploads to the object store that failed (each retried)", registry=r)
        self.store_dropped = Counter("weightsvc_store_uploads_dropped",
                                     "Versions dropped unwritten: the upload queue was full", registry=r)
        # The fabric data plane (--nixl): what readers read of leased versions, and the leases held.
        self.nixl_read_bytes = Counter("weightsvc_nixl_read_bytes", "Bytes readers read over NIXL (counted when a "
                                       "reader releases its lease in time)", ["model"], registry=r)
        self.nixl_reads = Counter("weightsvc_nixl_reads", "Reads over NIXL done within their lease", ["model"],
                                  registry=r)
        self.nixl_leases = Gauge("weightsvc_nixl_leases", "NIXL leases held (each holds its version)", registry=r)
        self.nixl_registered_bytes = Gauge("weightsvc_nixl_registered_bytes",
                                           "Bytes of versions registered with the NIXL agent", registry=r)
        self.nixl_failures = Counter("weightsvc_nixl_failures", "NIXL leases that failed, by reason", ["reason"],
                                     registry=r)
        for reason in NIXL_FAILURES:
            self.nixl_failures.labels(reason)
        r.register(_ClientCollector(self))
        self._clients: Callable[[], dict[str, list[ClientStatus]]] = dict
        self._lag_labels: dict[str, tuple[str, str, str]] = {}  # model -> its lag series' labels
        self._mismatch_labels: dict[str, tuple[str, str, str]] = {}  # model -> its mismatch gauges' labels
        for reason in REJECT_REASONS:
            self.pushes_rejected.labels(reason)
        for source in ("device", "host"):
            self.gpu_residual_chunks.labels(source)
        for transport, reason in DROP_REASONS:
            self.connections_dropped.labels(transport, reason)

    def observe_lag(self, model: str, format: str, rounding: str, lag: LagMetrics) -> None:
        labels = (model, format, rounding)
        # A model's series are those of the export it runs now: those of the one it ran before go
        # (a model that lagged under rtn must not keep its alert firing once it serves sr).
        before = self._lag_labels.get(model)
        if before is not None and before != labels:
            for series in (self.served_lag_steps, self.update_visibility, self.served_churn,
                           self.served_relative_error, self.saturated_elements):
                with contextlib.suppress(KeyError):
                    series.remove(*before)
        self._lag_labels[model] = labels
        self.served_lag_steps.labels(*labels).set(lag.lag_steps)
        # NaN while the update cannot be told from rounding noise: no alert compares true against it,
        # and the series does not keep a figure of an earlier version.
        visibility = lag.update_visibility
        self.update_visibility.labels(*labels).set(math.nan if visibility is None else visibility)
        self.served_churn.labels(*labels).set(lag.churn)
        self.served_relative_error.labels(*labels).set(lag.relative_error)
        self.saturated_elements.labels(*labels).inc(lag.saturated_elements)

    def observe_mismatch(self, model: str, added: Iterable[tuple[str, str, RolloutMismatch]],
                         latest: tuple[str, str, RolloutMismatch]) -> None:
        """A report: each version's tokens and sums, by its (format, rounding), and the totals of the
        latest version it names."""
        for format, rounding, m in added:
            labels = (model, format, rounding)
            self.mismatch_tokens.labels(*labels).inc(m.tokens)
            self.mismatch_k3_kl_sum.labels(*labels).inc(m.k3_kl * m.tokens)
            self.mismatch_abs_logp_delta_sum.labels(*labels).inc(m.mean_abs_logp_delta * m.tokens)
            self.mismatch_outside_band_tokens.labels(*labels).inc(m.outside_band * m.tokens)
        labels = (model, latest[0], latest[1])
        before = self._mismatch_labels.get(model)
        if before is not None and before != labels:  # the gauges follow the export the model runs now
            for gauge in (self.mismatch_k3_kl, self.mismatch_abs_logp_delta):
                with contextlib.suppress(KeyError):
                    gauge.remove(*before)
        self._mismatch_labels[model] = labels
        self.mismatch_k3_kl.labels(*labels).set(latest[2].k3_kl)
        self.mismatch_abs_logp_delta.labels(*labels).set(latest[2].mean_abs_logp_delta)

    def watch_clients(self, clients: Callable[[], dict[str, list[ClientStatus]]]) -> None:
        """Where the staleness figures come from: the clients not forgotten, per model."""
        self._clients = clients

    def render(self) -> bytes:
        return generate_latest(self.registry)


class _ClientCollector(Collector):
    """Serving staleness, computed from the acks at scrape time (labels: model only)."""

    def __init__(self, metrics: Metrics) -> None:
        self.metrics = metrics

    def describe(self) -> Iterable[Metric]:
        return []

    def collect(self) -> Iterable[Metric]:
        clients = GaugeMetricFamily("weightsvc_clients", "Inference clients that acked recently", labels=["model"])
        silent = GaugeMetricFamily(
            "weightsvc_clients_silent",
            "Clients that stopped acking (over 5 minutes ago) and are not forgotten yet (--client-forget-s)",
            labels=["model"],
        )
        worst = GaugeMetricFamily(
            "weightsvc_client_lag_versions",
            "Versions the most stale client is behind latest (a silent one counts until it is forgotten)",
            labels=["model"],
        )
        spread = HistogramMetricFamily(
            "weightsvc_client_staleness_versions", "Versions behind latest, over the clients not forgotten",
            labels=["model"],
        )
        for model, tracked in self.metrics._clients().items():
            lags = [c.lag_versions for c in tracked]
            clients.add_metric([model], sum(c.connected for c in tracked))
            silent.add_metric([model], sum(not c.connected for c in tracked))
            worst.add_metric([model], max(lags, default=0))
            buckets = [(str(b), sum(lag <= b for lag in lags)) for b in _LAG_BUCKETS] + [("+Inf", len(lags))]
            spread.add_metric([model], buckets, sum(lags))
        yield from (clients, silent, worst, spread)


# The steps of a follower's update (`weightsvc follow`), which label its failures.
FOLLOWER_STAGES = ("watch", "server", "connect", "stage", "pause", "swap", "resume", "verify", "ack", "load", "unload",
                   "internal")
FOLLOWER_PATHS = ("transfer", "collective_rpc", "lora")
_UPDATE_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300)


class FollowerMetrics:
    """The metrics of `weightsvc follow`, the sidecar of one inference engine (its own registry: it
    runs in its own process). Labels: the path into the engine and the stage of a failure."""

    def __init__(self) -> None:
        self.registry = r = CollectorRegistry(auto_describe=True)
        self.update_seconds = Histogram(
            "weightsvc_follower_update_seconds", "From the start of an update (staging) to the engine serving it",
            ["path"], buckets=_UPDATE_BUCKETS, registry=r,
        )
        self.pause_seconds = Histogram(
            "weightsvc_follower_pause_seconds", "How long each update held the engine's generation paused",
            ["path"], buckets=_UPDATE_BUCKETS, registry=r,
        )
        self.versions_behind = Gauge(
            "weightsvc_follower_versions_behind", "Versions the engine serves behind the latest committed", registry=r
        )
        self.engine_version = Gauge(
            "weightsvc_follower_engine_version", "The version the engine serves (-1: none of weightsvc's)", registry=r
        )
        self.live_revisions = Gauge(
            "weightsvc_follower_live_revisions", "Revisions of an adapter model the engine holds loaded "
            "(--max-live); those unloaded whose requests still run are not counted", registry=r
        )
        self.failures = Counter(
            "weightsvc_follower_failures", "Failed steps of updates, by stage (each is retried)", ["stage"], registry=r
        )
        for stage in FOLLOWER_STAGES:
            self.failures.labels(stage)
        for path in FOLLOWER_PATHS:
            self.update_seconds.labels(path)
            self.pause_seconds.labels(path)

    def updated(self, path: str, update_s: float, pause_s: float) -> None:
        self.update_seconds.labels(path).observe(update_s)
        self.pause_seconds.labels(path).observe(pause_s)

    def failed(self, stage: str) -> None:
        self.failures.labels(stage if stage in FOLLOWER_STAGES else "swap").inc()

    def live(self, revisions: int) -> None:
        self.live_revisions.set(revisions)

    def position(self, served: int | None, latest: int | None) -> None:
        self.engine_version.set(-1 if served is None else served)
        if latest is not None:
            self.versions_behind.set(latest - (served or 0))

    def render(self) -> bytes:
        return generate_latest(self.registry)
