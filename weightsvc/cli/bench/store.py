"""store: the object store (--object-store) against the store's own raw PUT and GET of the same bytes.

For rtn, sr-sticky and sr: the bytes written per version (full, then the deltas of two steps of
lr 3e-6, every element moving), the upload of the full version (commit answered → its marker in the
store) and the pull of it from the store alone (`InferenceClient("s3://...")`, checksums verified),
each against a raw PUT and GET of its object in the same run. The store is $WEIGHTSVC_OBJECT_STORE
(s3://BUCKET/PREFIX, reached with the AWS_* environment); without it the part is skipped.
"""

from __future__ import annotations

import functools
import os
import time
import uuid
from collections.abc import Callable
from typing import Any

import torch


def store_bench(model: dict[str, torch.Tensor], *, repeat: int, say: Callable[[str], Any]) -> dict[str, Any]:
    from weightsvc import InferenceClient, LearnerClient, Settings
    from weightsvc.server.server import BackgroundServer
    from weightsvc.store import Bucket, StoreReader, StoreUrl

    base = os.environ.get("WEIGHTSVC_OBJECT_STORE")
    if not base:
        return {"details": {"store": "skipped: set WEIGHTSVC_OBJECT_STORE=s3://BUCKET/PREFIX (and AWS_*)"}}
    out: dict[str, Any] = {"details": {}}
    for mode in ("rtn", "sr-sticky", "sr"):
        url = f"{base.rstrip('/')}/bench-{uuid.uuid4().hex[:8]}"
        settings = Settings(grpc_port=0, http_port=0, probe_port=0, rounding=mode, object_store=url, full_every=100,
                            retain=4)
        with BackgroundServer(settings) as srv, LearnerClient(srv.grpc_target) as learner:
            publisher = srv.service.publisher
            assert publisher is not None
            masters, upload_s = dict(model), float("inf")
            gen = torch.Generator().manual_seed(1)
            for step in (1, 2, 3):
                if step > 1:
                    masters = {k: v + 3e-6 * torch.sign(torch.randn(v.shape, generator=gen))
                               for k, v in masters.items()}
                learner.push(step, masters, model="bench")
                started = time.perf_counter()
                srv.call(publisher.drained())
                if step == 1:
                    upload_s = time.perf_counter() - started
            reader = StoreReader(Bucket(StoreUrl.parse(url)))
            sizes = [reader.marker("bench", v).nbytes for v in (1, 2, 3)]
            full = reader.marker("bench", 1)
            raw = reader.bucket.get(full.object)
            bucket = reader.bucket
            put_s = _best(repeat, functools.partial(bucket.put, "raw", raw))
            get_s = _best(repeat, functools.partial(bucket.get, "raw"))
            with InferenceClient(url) as remote:
                pull_s = _best(repeat, functools.partial(remote.pull_data, "bench", 1))
            bucket.delete("raw")
        key = mode.replace("-", "_")
        out[f"store_full_bytes_{key}"] = sizes[0]
        out[f"store_delta_bytes_{key}"] = max(sizes[1:])
        out[f"store_upload_ratio_{key}"] = round(put_s / upload_s, 3)
        out[f"store_pull_ratio_{key}"] = round(get_s / pull_s, 3)
        out["details"][f"store_seconds_{key}"] = {"upload": round(upload_s, 3), "raw_put": round(put_s, 3),
                                                  "pull": round(pull_s, 3), "raw_get": round(get_s, 3)}
        say(f"store {mode}: full {sizes[0]} B, deltas {sizes[1:]} B; upload {upload_s:.2f} s vs raw PUT "
            f"{put_s:.2f} s; pull {pull_s:.2f} s vs raw GET {get_s:.2f} s")
    return out


def _best(repeat: int, run: Callable[[], Any]) -> float:
    times = []
    for _ in range(repeat):
        started = time.perf_counter()
        run()
        times.append(time.perf_counter() - started)
    return min(times)
