"""Relays: a server that mirrors every committed version of an upstream weightsvc and serves it.

`weightsvc serve --relay-from HOST:PORT` builds a fan-out tree: learners push to the upstream; each
relay follows it (a Watch per model, models discovered with ListModels), pulls each new version as a
delta against the one it holds, verifies every checksum, and commits the same bytes and manifest
locally (same version number, commit time and lag metrics). Inference servers pull, watch and ack at
the relay. A relay refuses pushes. If the upstream goes away, the relay keeps serving what it has and
catches up when it comes back.

Nothing the upstream says is trusted: one client (one channel, so one connection, whatever the number
of models) checks every manifest before anything is allocated for it (`check_manifest`), the service
checks it again before anything touches the disk, and what the relay takes is bounded by its own
limits: --max-models models followed, one version pulled at a time, no larger than
--max-version-bytes, --max-staged-bytes or the room under --max-rss-bytes.

The relay is a set of asyncio tasks on the server's loop (one discovers models, one follows each
model), so everything it reads of the store or commits happens on the loop; the sync client's
blocking calls run in the relay's own threads (a watch holds one while it waits). Whatever fails is
logged, counted in `weightsvc_relay_failures_total` by stage (a refused version also in
`weightsvc_relay_refused_total` by reason), and retried: nothing stops a relay but `stop`.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
from collections.abc import Callable, Generator, Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import TYPE_CHECKING, Any, TypeVar

from weightsvc.client import InferenceClient, Limits, VersionInfo, verify_data
from weightsvc.errors import DataLoss, InvalidArgument, NotFound, ResourceExhausted, WeightsvcError
from weightsvc.memory import anonymous_bytes
from weightsvc.protocol.refs import check_model_name

if TYPE_CHECKING:
    from weightsvc.service.service import Service

log = logging.getLogger("weightsvc.relay")
T = TypeVar("T")

DISCOVER_EVERY_S = 2.0  # how often the relay asks the upstream for models it does not follow yet
RETRY_AFTER_S = 1.0


class Relay:
    def __init__(self, upstream: str, service: Service) -> None:
        self.upstream = upstream
        self.service = service
        s = service.settings
        # Every model's calls share its channel; its limits are set before each pull (`_room`).
        self._client = InferenceClient(upstream, limits=Limits(s.max_version_bytes, s.max_tensors))
        # A thread per watch (it blocks while it waits), two more for the other calls; not the loop's
        # default executor, which the service's file I/O needs.
        self._threads = ThreadPoolExecutor(s.max_models + 2, thread_name_prefix="weightsvc-relay")
        self._pulling = asyncio.Lock()  # one version at a time: what a relay stages is one version
        self._followers: dict[str, asyncio.Task[None]] = {}
        self._unfollowed: dict[str, int] = {}  # reason -> models not followed, as last logged
        self._discover: asyncio.Task[None] | None = None

    def start(self) -> None:
        self._discover = asyncio.create_task(self._discover_models(), name="relay-discover")

    async def stop(self) -> None:
        self._client.close()  # breaks the watch streams that threads are blocked in
        tasks = [t for t in (self._discover, *self._followers.values()) if t is not None]
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        self._threads.shutdown(wait=False, cancel_futures=True)

    async def _run(self, call: Callable[..., T], *args: Any, **kwargs: Any) -> T:
        """A blocking call of the client, in one of the relay's threads."""
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self._threads, functools.partial(call, *args, **kwargs))

    def _failed(self, stage: str, what: str, e: BaseException) -> None:
        self.service.metrics.relay_failures.labels(stage).inc()
        expected = isinstance(e, WeightsvcError | ValueError | OSError)  # the upstream's answers, the network
        log.warning("relay: %s %s of %s failed (retrying): %s: %s", stage, what, self.upstream,
                    type(e).__name__, e, exc_info=None if expected else e)

    async def _discover_models(self) -> None:
        while True:
            try:
                self._follow_listed([summary["model"] for summary in await self._run(self._client.models)])
            except Exception as e:
                self._failed("discover", "the models", e)
            await asyncio.sleep(DISCOVER_EVERY_S)

    def _follow_listed(self, listed: list[str]) -> None:
        """Follow the models the upstream lists, up to --max-models in all (counting those this relay
        holds already); a name no model can have is not followed (it would name a path)."""
        limit = self.service.settings.max_models
        held = set(self.service.held_models()) | set(self._followers)
        unfollowed = {"invalid_name": 0, "max_models": 0}
        for model in listed:
            if model in self._followers:
                continue
            try:
                check_model_name(model)
            except InvalidArgument:
                unfollowed["invalid_name"] += 1
                continue
            if model not in held:
                if len(held) >= limit:
                    unfollowed["max_models"] += 1
                    continue
                held.add(model)
            self._followers[model] = asyncio.create_task(self._follow(model), name=f"relay-{model}")
        metrics = self.service.metrics
        metrics.relay_followed.set(len(self._followers))
        for reason, count in unfollowed.items():
            metrics.relay_unfollowed.labels(reason).set(count)
        if unfollowed != self._unfollowed and any(unfollowed.values()):
            log.warning("relay: %s lists %d models; %d not followed (--max-models %d), %d with names no model can "
                        "have", self.upstream, len(listed), unfollowed["max_models"], limit,
                        unfollowed["invalid_name"])
        self._unfollowed = unfollowed

    async def _follow(self, model: str) -> None:
        while True:
            stage = "follow"
            events: Generator[VersionInfo, None, None] | None = None
            try:
                # Start from the newest upstream version: older ones are not worth the bytes.
                upstream = await self._run(self._client.versions, model)
                local = self.service.latest(model)
                after = max(local if local is not None else -1, upstream[-1].version - 1 if upstream else -1)
                events = self._client.watch(model, after=after)
                while (info := await self._run(_next, events)) is not None:
                    stage = "mirror"
                    await self._mirror(model, info.version)
                    stage = "follow"
            except NotFound:
                pass  # the model's versions expired upstream; it may come back
            except Exception as e:
                self._failed(stage, f"model {model!r}", e)
            finally:
                if events is not None:
                    with contextlib.suppress(ValueError):  # (a thread still in it: closing the client ends it)
                        events.close()  # its stream, now: not when the generator is collected
            await asyncio.sleep(RETRY_AFTER_S)

    async def _mirror(self, model: str, version: int) -> None:
        async with self._pulling:
            local = self.service.latest(model)
            if local is not None and version <= local:
                return
            held = self._client.held(model)
            limit, flag = self._room()
            self._client.limits.max_bytes = limit
            try:
                manifest, data = await self._run(self._client.pull_data, model, version,
                                                 base=held.version if held is not None else None)
                await self._run(verify_data, manifest, data)  # every checksum, before anything is served
                await self.service.mirror(manifest, data)
            except DataLoss:
                self.service.metrics.relay_refused.labels("invalid").inc()
                raise
            except ResourceExhausted as e:
                if e.reason not in ("too_large", "too_many"):
                    raise  # the upstream's own answer (busy): not a refusal
                self.service.metrics.relay_refused.labels(e.reason).inc()
                if e.reason == "too_large":
                    limits = f"{limit} bytes: {flag}; {self._client.limits.max_tensors} tensors: --max-tensors"
                    raise ResourceExhausted(f"{e.message} (this relay takes {limits})", reason=e.reason) from None
                raise
            # The next pull's delta base: the committed version (with a data dir, its file's pages),
            # so the pulled buffer goes, and the relay holds no version per model in its own memory.
            committed = self.service.committed(model, version)
            if committed is not None:
                self._client.hold(*committed)
            log.info("relayed model=%s version=%d bytes=%d pulled=%d", model, version, len(data),
                     self._client.last_pull_bytes)

    def _room(self) -> tuple[int, str]:
        """The largest data section the relay takes now, and the limit that sets it."""
        s = self.service.settings
        return min((s.max_version_bytes, "--max-version-bytes"), (s.max_staged_bytes, "--max-staged-bytes"),
                   (max(0, s.rss_high_water - anonymous_bytes()), "room under --max-rss-bytes"))


def _next(events: Iterator[VersionInfo]) -> VersionInfo | None:
    return next(events, None)
