"""One S3 bucket and prefix, reached with boto3: objects put, read, listed and deleted, and S3's
errors as domain errors.

The endpoint, region and credentials come from the environment as every S3 tool reads them
(`AWS_ENDPOINT_URL`, `AWS_REGION`, `AWS_ACCESS_KEY_ID`, `AWS_SECRET_ACCESS_KEY`, a profile, an
instance role, ...). boto3 is the `s3` extra, loaded by the first store opened.

Every call blocks: the service runs them in worker threads.
"""

from __future__ import annotations

import io
import re
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

from weightsvc.errors import (
    DataLoss,
    InvalidArgument,
    NotFound,
    PermissionDenied,
    Unauthenticated,
    Unavailable,
    WeightsvcError,
)
from weightsvc.memory import alloc

SCHEME = "s3://"
READ_BYTES = 4 << 20  # one read of an object's body into its buffer
PART_BYTES = 64 << 20  # uploads above this go in parts of this size
_BUCKET = re.compile(r"[a-z0-9][a-z0-9.-]{1,61}[a-z0-9]")
# S3 error codes that say the credentials are wrong or missing, and those that say they may not do it.
_UNAUTHENTICATED = {"InvalidAccessKeyId", "SignatureDoesNotMatch", "InvalidToken", "ExpiredToken",
                    "AuthorizationHeaderMalformed"}
_DENIED = {"AccessDenied", "AllAccessDisabled", "403"}


def is_store(target: str) -> bool:
    return target.startswith(SCHEME)


@dataclass(frozen=True)
class StoreUrl:
    """`s3://BUCKET/PREFIX`: where a deployment's versions live."""

    bucket: str
    prefix: str  # without a trailing '/'; may be empty

    @classmethod
    def parse(cls, url: str) -> StoreUrl:
        if not is_store(url):
            raise InvalidArgument(f"object store {url!r}: give it as s3://BUCKET/PREFIX")
        bucket, _, prefix = url[len(SCHEME):].partition("/")
        if not _BUCKET.fullmatch(bucket):
            raise InvalidArgument(f"object store {url!r}: {bucket!r} is no S3 bucket name (3-63 characters: a-z, "
                                  "0-9, '.', '-')")
        return cls(bucket, prefix.strip("/"))

    def key(self, name: str) -> str:
        return f"{self.prefix}/{name}" if self.prefix else name

    def __str__(self) -> str:
        return f"{SCHEME}{self.bucket}/{self.prefix}" if self.prefix else f"{SCHEME}{self.bucket}"


class Bucket:
    """The objects under one `StoreUrl`; names are relative to its prefix."""

    def __init__(self, url: StoreUrl, *, timeout: float = 30.0, threads: int = 8) -> None:
        try:
            import boto3
            from boto3.s3.transfer import TransferConfig
            from botocore.config import Config
        except ImportError:
            raise InvalidArgument(f"object store {url}: boto3 is not installed (pip install 'weightsvc[s3]')") from None
        self.url = url
        config = Config(connect_timeout=min(timeout, 10.0), read_timeout=timeout, max_pool_connections=threads * 2,
                        retries={"max_attempts": 2, "mode": "standard"})
        self._s3 = boto3.session.Session().client("s3", config=config)
        self._transfer = TransferConfig(multipart_threshold=PART_BYTES, multipart_chunksize=PART_BYTES,
                                        max_concurrency=threads)

    @property
    def endpoint(self) -> str:
        return str(self._s3.meta.endpoint_url)

    def put(self, name: str, *body: bytes | memoryview) -> None:
        """Write the object whole, its bytes the pieces of `body` back to back (in parts above
        `PART_BYTES`: an upload cut short leaves no object)."""
        with self._errors(name):
            self._s3.upload_fileobj(_Reader(body), self.url.bucket, self.url.key(name), Config=self._transfer)

    def get(self, name: str, span: tuple[int, int] | None = None, into: memoryview | None = None, *,
            max_bytes: int | None = None) -> memoryview:
        """The object's bytes (`span`: bytes [start, end) of it), read into `into` when given. An object
        larger than `max_bytes` (what the reader knows it can be) is DATA_LOSS, before it is read.
        A range the object does not hold whole is DATA_LOSS too: the reader asked for what it says it holds."""
        extra = {"Range": f"bytes={span[0]}-{span[1] - 1}"} if span is not None else {}
        with self._errors(name):
            response = self._s3.get_object(Bucket=self.url.bucket, Key=self.url.key(name), **extra)
            size = int(response["ContentLength"])
            if max_bytes is not None and size > max_bytes:
                response["Body"].close()
                raise DataLoss(f"{self._where(name)}: {size} bytes, more than the {max_bytes} it can hold")
            if span is not None and size != span[1] - span[0]:
                response["Body"].close()
                raise DataLoss(f"{self._where(name)}: bytes [{span[0]}, {span[1]}) were read and {size} came: the "
                               "object is shorter")
            out = into if into is not None else alloc(size)
            if len(out) != size:
                raise Unavailable(f"{self._where(name)}: {size} bytes where {len(out)} were expected")
            body, pos = response["Body"], 0
            while pos < size:
                piece = body.read(min(READ_BYTES, size - pos))
                if not piece:
                    raise Unavailable(f"{self._where(name)}: the body ended at byte {pos} of {size}")
                out[pos : pos + len(piece)] = piece
                pos += len(piece)
            return out

    def size(self, name: str) -> int:
        """The object's size in bytes (NOT_FOUND: no such object)."""
        with self._errors(name):
            return int(self._s3.head_object(Bucket=self.url.bucket, Key=self.url.key(name))["ContentLength"])

    def names(self, under: str) -> Iterator[str]:
        """The names of the objects under `under` (a folder: ends with '/'), in S3's (byte) order."""
        with self._errors(under):
            pages = self._s3.get_paginator("list_objects_v2").paginate(Bucket=self.url.bucket,
                                                                        Prefix=self.url.key(under))
            strip = len(self.url.key(""))
            for page in pages:
                for item in page.get("Contents", ()):
                    yield item["Key"][strip:]

    def folders(self, under: str) -> list[str]:
        """The names of the folders right under `under` (without their '/')."""
        with self._errors(under):
            pages = self._s3.get_paginator("list_objects_v2").paginate(Bucket=self.url.bucket,
                                                                        Prefix=self.url.key(under), Delimiter="/")
            strip = len(self.url.key(under))
            return [p["Prefix"][strip:].rstrip("/") for page in pages for p in page.get("CommonPrefixes", ())]

    def delete(self, name: str) -> None:
        with self._errors(name):
            self._s3.delete_object(Bucket=self.url.bucket, Key=self.url.key(name))

    def close(self) -> None:
        self._s3.close()

    def _where(self, name: str) -> str:
        return f"object store {self.url} (endpoint {self.endpoint}), object {name!r}"

    def _errors(self, name: str) -> _Errors:
        return _Errors(self._where(name))


class _Errors:
    """S3's answers as domain errors naming the object; never the credentials themselves."""

    def __init__(self, where: str) -> None:
        self.where = where

    def __enter__(self) -> None:
        return None

    def __exit__(self, kind: type[BaseException] | None, e: BaseException | None, tb: Any) -> None:
        if e is None or isinstance(e, WeightsvcError):
            return
        from botocore.exceptions import BotoCoreError, ClientError, NoCredentialsError

        if isinstance(e, NoCredentialsError):
            raise Unauthenticated(f"{self.where}: no S3 credentials (set AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY, "
                                  "or a profile or role)") from None
        if isinstance(e, ClientError):
            error = e.response.get("Error", {})
            code = str(error.get("Code", ""))
            status = int(e.response.get("ResponseMetadata", {}).get("HTTPStatusCode", 0))
            said = f"{self.where}: {code or status}: {error.get('Message', '')}".rstrip(": ")
            if code in ("NoSuchKey", "404", "NotFound"):
                raise NotFound(f"{self.where}: no such object") from None
            if code == "InvalidRange":  # (the reader asks for the ranges the object says it holds)
                raise DataLoss(f"{said}: the object is shorter than the range read") from None
            if code == "NoSuchBucket":
                raise NotFound(f"{self.where}: no such bucket") from None
            if code in _UNAUTHENTICATED:
                raise Unauthenticated(f"{said} (check AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY)") from None
            if code in _DENIED or status == 403:
                raise PermissionDenied(f"{said} (the credentials may not do this)") from None
            raise Unavailable(said) from None
        if isinstance(e, BotoCoreError | OSError):
            raise Unavailable(f"{self.where}: {type(e).__name__}: {e}") from None


class _Reader(io.RawIOBase):
    """A file over pieces of bytes already in memory, back to back, for boto3 to upload without
    joining them (a copy of a whole version)."""

    def __init__(self, pieces: tuple[bytes | memoryview, ...]) -> None:
        self._pieces = [memoryview(p).cast("B") for p in pieces]
        self._starts = [sum(len(p) for p in self._pieces[:i]) for i in range(len(self._pieces))]
        self._size = sum(len(p) for p in self._pieces)
        self._pos = 0

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def readinto(self, b: Any) -> int:
        """As many bytes as `b` takes, across pieces (a short read would be taken for a whole part)."""
        out, filled = memoryview(b).cast("B"), 0
        for piece, start in zip(self._pieces, self._starts, strict=True):
            if filled == len(out):
                break
            if start <= self._pos < start + len(piece):
                at = self._pos - start
                n = min(len(out) - filled, len(piece) - at)
                out[filled : filled + n] = piece[at : at + n]
                self._pos += n
                filled += n
        return filled

    def seek(self, offset: int, whence: int = io.SEEK_SET) -> int:
        base = {io.SEEK_SET: 0, io.SEEK_CUR: self._pos, io.SEEK_END: self._size}[whence]
        self._pos = max(0, base + offset)
        return self._pos

    def tell(self) -> int:
        return self._pos
