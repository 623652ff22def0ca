"""The registry shared by replicas, in Redis (`--redis-url`). A commit is one Lua script (check the
step, add the version, record its manifest, append the event, apply retention), events are a Redis
Stream per model, acks a hash."""

from __future__ import annotations

import asyncio
import dataclasses
import functools
import hashlib
import json
from collections.abc import AsyncIterator, Mapping, Sequence
from typing import Any

from weightsvc.errors import Unavailable, subject
from weightsvc.protocol.mismatch import DEFAULT_BAND, MAX_TOKENS
from weightsvc.protocol.topology import REPLICA_TTL_S, Replica
from weightsvc.service.replicas.registry import (
    ACKS_KEPT,
    EVENTS_KEPT,
    PART_TTL_S,
    CommitResult,
    MismatchRecord,
    band_conflict,
    conflict,
    diverged_error,
    not_above,
    totals_overflow,
)

# Every script's KEYS: versions (zset), manifests (hash), digests (hash), events (stream), models (set),
# and for parts: the pending parts of the version (hash). `finish` and `_COMMIT_PART` are the commit rule
# (`registry.commit_rule`, `registry.part_rule`) in Lua: tests/integration/test_commit_rule.py holds them to it.
_FINISH = """
-- Drop all but the newest `retain` versions; the ones dropped, oldest first.
local function retain_newest(retain)
  local dropped = {}
  local extra = redis.call('ZCARD', KEYS[1]) - tonumber(retain)
  if extra > 0 then
    dropped = redis.call('ZRANGE', KEYS[1], 0, extra - 1)
    for _, o in ipairs(dropped) do
      redis.call('ZREM', KEYS[1], o)
      redis.call('HDEL', KEYS[2], o)
      redis.call('HDEL', KEYS[3], o)
    end
  end
  return dropped
end

local function finish(model, v, digest, manifest, retain, kept)
  local existing = redis.call('HGET', KEYS[3], v)
  if existing then
    if existing == digest then return {'exists'} end
    return {'conflict', existing}
  end
  local top = redis.call('ZREVRANGE', KEYS[1], 0, 0)
  if top[1] and tonumber(top[1]) > tonumber(v) then return {'not_above', top[1]} end
  redis.call('ZADD', KEYS[1], tonumber(v), v)
  redis.call('HSET', KEYS[2], v, manifest)
  redis.call('HSET', KEYS[3], v, digest)
  redis.call('SADD', KEYS[5], model)
  redis.call('XADD', KEYS[4], 'MAXLEN', '~', kept, '*', 'version', v)
  local result = {'created'}
  for _, o in ipairs(retain_newest(retain)) do
    table.insert(result, o)
  end
  return result
end
"""
# ARGV: model, version, digest, manifest, retain, events kept
_COMMIT = _FINISH + "return finish(ARGV[1], ARGV[2], ARGV[3], ARGV[4], ARGV[5], ARGV[6])"
# ARGV: model, version, digest, manifest, retain. A version a server holds and the registry lost: added
# below the latest too, without an event; retention applies.
_RESTORE = _FINISH + """
local v, digest = ARGV[2], ARGV[3]
local existing = redis.call('HGET', KEYS[3], v)
if existing then
  if existing == digest then return {'held'} end
  return {'conflict', existing}
end
redis.call('ZADD', KEYS[1], tonumber(v), v)
redis.call('HSET', KEYS[2], v, ARGV[4])
redis.call('HSET', KEYS[3], v, digest)
redis.call('SADD', KEYS[5], ARGV[1])
for _, o in ipairs(retain_newest(ARGV[5])) do
  if o == v then return {'evicted'} end
end
return {'held'}
"""
# ARGV: model, version, owner, owners (JSON list, sorted), part digest, part manifest, retain, events kept,
# ms the pending parts live, the digests of the part's groups (JSON object). The parts of one set of
# owners are gathered (KEYS[6] is theirs); the last one commits the version if the owners of each group
# agree on its bytes.
_COMMIT_PART = (
    _FINISH
    + """
local v, owner = ARGV[2], ARGV[3]
local committed = redis.call('HGET', KEYS[2], v)
if committed then
  local part = cjson.decode(committed)[owner]  -- (a whole version's manifest holds other fields: no part)
  if type(part) == 'table' and part['digest'] == ARGV[5] then return {'exists'} end
  return {'conflict', redis.call('HGET', KEYS[3], v)}
end
local top = redis.call('ZREVRANGE', KEYS[1], 0, 0)
if top[1] and tonumber(top[1]) > tonumber(v) then return {'not_above', top[1]} end
local record = {digest = ARGV[5], manifest = ARGV[6], groups = cjson.decode(ARGV[10])}
redis.call('HSET', KEYS[6], owner, cjson.encode(record))
redis.call('PEXPIRE', KEYS[6], ARGV[9])
local owners, parts, lines, seen = cjson.decode(ARGV[4]), {}, {}, {}
for _, o in ipairs(owners) do
  local raw = redis.call('HGET', KEYS[6], o)
  if not raw then return {'pending'} end
  parts[o] = cjson.decode(raw)
  table.insert(lines, o .. ':' .. parts[o]['digest'])
end
redis.call('DEL', KEYS[6])
for _, o in ipairs(owners) do
  for group, digest in pairs(parts[o]['groups']) do
    if seen[group] and seen[group] ~= digest then return {'diverged', group} end
    seen[group] = digest
  end
end
return finish(ARGV[1], v, 'sha1:' .. redis.sha1hex(table.concat(lines, '\\n')), cjson.encode(parts), ARGV[7], ARGV[8])
"""
)
# ARGV: version, owner. 1: the part is withdrawn; 0: too late, the version committed.
_WITHDRAW_PART = """
if redis.call('HGET', KEYS[3], ARGV[1]) then return 0 end
redis.call('HDEL', KEYS[6], ARGV[2])
return 1
"""


def _honour_cancel() -> None:
    """Raise the cancel of the running task if a redis-py call let it pass: cancelled mid-XREAD BLOCK,
    the read ended as if it had not been (or as a lost connection), and a loop that reads again, or
    retries on UNAVAILABLE, would never end."""
    task = asyncio.current_task()
    if task is not None and task.cancelling():
        raise asyncio.CancelledError


# KEYS: the acks (hash: client id -> [version, unix, caller]), their times (zset). ARGV: client id, ack,
# caller, unix, horizon (older acks go), acks kept, keep ms. 0: the id belongs to another caller.
_ACK = """
local held = redis.call('HGET', KEYS[1], ARGV[1])
if held then
  held = cjson.decode(held)  -- [version, unix, caller] (no caller in an ack recorded before callers were)
  if held[3] and held[3] ~= ARGV[3] and held[2] >= tonumber(ARGV[5]) then return 0 end
end
redis.call('HSET', KEYS[1], ARGV[1], ARGV[2])
redis.call('ZADD', KEYS[2], ARGV[4], ARGV[1])
local gone = redis.call('ZRANGEBYSCORE', KEYS[2], '-inf', '(' .. ARGV[5])
local extra = redis.call('ZCARD', KEYS[2]) - #gone - tonumber(ARGV[6])
if extra > 0 then
  for _, id in ipairs(redis.call('ZRANGE', KEYS[2], #gone, #gone + extra - 1)) do table.insert(gone, id) end
end
for _, id in ipairs(gone) do
  redis.call('HDEL', KEYS[1], id)
  redis.call('ZREM', KEYS[2], id)
end
redis.call('PEXPIRE', KEYS[1], ARGV[7])
redis.call('PEXPIRE', KEYS[2], ARGV[7])
return 1
"""


# KEYS: the model's mismatch records (hash: "<version>:<field>" -> a number). ARGV: the retained versions
# (JSON, as strings: cjson would round big numbers), the most tokens a record holds, then per added version:
# version, tokens, |log r| sum, k3 sum, outside-band tokens, step ("": none), band ("low,high"). Sums add in
# Redis's long doubles (HINCRBYFLOAT), not through cjson, which keeps 14 digits. Every check comes before
# the first write (a script that fails keeps what it wrote before): returns the added versions' totals, in
# order, each [tokens, abs, k3, outside, step]; or, adding nothing, {"band", version, its band, ...} for the
# versions reported before with another band, or {"overflow", version, ...} for the versions whose totals
# would go past what a record holds (`MismatchRecord.fits`).
_ADD_MISMATCH = """
local function finite(x) return x ~= nil and x == x and x > -math.huge and x < math.huge end
local keep = {}
for _, v in ipairs(cjson.decode(ARGV[1])) do keep[v] = true end
local max_tokens = tonumber(ARGV[2])
local conflicts, overflown = {'band'}, {'overflow'}
for i = 3, #ARGV, 7 do
  local v = ARGV[i]
  local had = {}
  if keep[v] then  -- (a version not kept starts afresh)
    had = redis.call('HMGET', KEYS[1], v .. ':band', v .. ':tokens', v .. ':abs', v .. ':k3', v .. ':outside')
  end
  if had[1] and had[1] ~= ARGV[i + 6] then
    table.insert(conflicts, v)
    table.insert(conflicts, had[1])
  end
  local held, tokens = tonumber(had[2] or '0'), tonumber(ARGV[i + 1])
  -- (an integer string: above 2^53 its double rounds, but never to or below the room left, an exact integer)
  local fits = held ~= nil and string.match(ARGV[i + 1], '^%d+$') ~= nil and tokens >= 1 and tokens <= max_tokens - held
  for j = 1, 3 do
    local sum, add = tonumber(had[2 + j] or '0'), tonumber(ARGV[i + 1 + j])
    fits = fits and finite(sum) and finite(add) and add >= 0 and finite(sum + add)
  end
  if not fits then table.insert(overflown, v) end
end
if #conflicts > 1 then return conflicts end
if #overflown > 1 then return overflown end
for _, field in ipairs(redis.call('HKEYS', KEYS[1])) do
  if not keep[string.match(field, '^[^:]*')] then redis.call('HDEL', KEYS[1], field) end
end
local out = {}
for i = 3, #ARGV, 7 do
  local v = ARGV[i]
  local total = {redis.call('HINCRBY', KEYS[1], v .. ':tokens', ARGV[i + 1])}
  for j, field in ipairs({'abs', 'k3', 'outside'}) do
    table.insert(total, redis.call('HINCRBYFLOAT', KEYS[1], v .. ':' .. field, ARGV[i + 1 + j]))
  end
  if ARGV[i + 5] ~= '' then redis.call('HSET', KEYS[1], v .. ':step', ARGV[i + 5]) end
  redis.call('HSET', KEYS[1], v .. ':band', ARGV[i + 6])
  table.insert(total, redis.call('HGET', KEYS[1], v .. ':step') or '')
  table.insert(out, total)
end
return out
"""


def _band_text(band: tuple[float, float]) -> str:
    return f"{band[0]!r},{band[1]!r}"


def _band(text: Any) -> tuple[float, float]:
    if text is None:
        return DEFAULT_BAND
    low, high = (float(x) for x in (text.decode() if isinstance(text, bytes) else text).split(","))
    return low, high


def _record(tokens: Any, abs_sum: Any, k3_sum: Any, outside: Any, step: Any, band: Any) -> MismatchRecord:
    step = step.decode() if isinstance(step, bytes) else step
    return MismatchRecord(int(tokens), float(abs_sum), float(k3_sum), float(outside),
                          int(step) if step not in (None, "") else None, _band(band))


class RedisRegistry:
    """The registry shared by replicas, in Redis. Losing Redis raises UNAVAILABLE; redis-py
    reconnects by itself on the next call."""

    def __init__(self, url: str, prefix: str = "weightsvc", socket_timeout: float = 5.0) -> None:
        import redis.asyncio as aioredis

        self.url = url
        self.prefix = prefix
        self._redis = aioredis.Redis.from_url(url, socket_connect_timeout=2, socket_timeout=socket_timeout,
                                              health_check_interval=10)
        # A blocking read of a model's events waits well under the socket timeout, which would
        # otherwise end an idle watch (and a part waiting for the other owners') with UNAVAILABLE.
        self._block_ms = max(1, int(socket_timeout * 400))
        self._commit = self._redis.register_script(_COMMIT)
        self._restore = self._redis.register_script(_RESTORE)
        self._commit_part = self._redis.register_script(_COMMIT_PART)
        self._withdraw_part = self._redis.register_script(_WITHDRAW_PART)

    def _key(self, model: str, what: str) -> str:
        return f"{self.prefix}:{{{model}}}:{what}"  # one hash slot per model: the script's keys on a cluster

    def _unavailable(self, what: str, e: Exception) -> Unavailable:
        return Unavailable(f"registry {self.url} unreachable while {what}: {e}", reason="registry")

    async def _call(self, what: str, coro: Any) -> Any:
        from redis.exceptions import ConnectionError, TimeoutError

        try:
            result = await coro
        except (ConnectionError, TimeoutError, OSError) as e:
            _honour_cancel()
            raise self._unavailable(what, e) from None
        _honour_cancel()
        return result

    async def commit(self, model: str, version: int, digest: str, manifest: str, retain: int) -> CommitResult:
        args: list[str | int] = [model, version, digest, manifest, retain, EVENTS_KEPT]
        out = await self._call(f"committing {subject(model, version)}",
                               self._commit(keys=self._keys(model), args=args))
        status, *rest = [x.decode() if isinstance(x, bytes) else str(x) for x in out]
        return self._decided(model, version, digest, status, rest)

    @staticmethod
    def _decided(model: str, version: int, digest: str, status: str, rest: list[str]) -> CommitResult:
        if status == "exists":
            return CommitResult(created=False)
        if status == "conflict":
            raise conflict(model, version, rest[0], digest)
        if status == "not_above":
            raise not_above(model, version, int(rest[0]))
        return CommitResult(created=True, evicted=tuple(int(v) for v in rest))

    def _keys(self, model: str, version: int | None = None, owners: Sequence[str] = ()) -> list[str]:
        keys = [self._key(model, k) for k in ("versions", "manifests", "digests", "events")] + [f"{self.prefix}:models"]
        if version is None:
            return keys
        of = hashlib.sha1(json.dumps(sorted(owners)).encode()).hexdigest()[:16]
        return [*keys, self._key(model, f"pending:{version}:{of}")]

    async def commit_part(
        self, model: str, version: int, owner: str, owners: Sequence[str], digest: str, manifest: str, retain: int,
        groups: Mapping[str, str] | None = None,
    ) -> CommitResult | None:
        owners_json = json.dumps(sorted(owners))
        ttl_ms = int(PART_TTL_S * 1000)
        args: list[str | int] = [model, version, owner, owners_json, digest, manifest, retain, EVENTS_KEPT, ttl_ms,
                                 json.dumps(dict(groups or {}))]
        out = await self._call(f"committing replica {owner!r}'s part of {subject(model, version)}",
                               self._commit_part(keys=self._keys(model, version, owners), args=args))
        status, *rest = [x.decode() if isinstance(x, bytes) else str(x) for x in out]
        if status == "pending":
            return None
        if status == "diverged":
            raise diverged_error(model, version, rest[0])
        return self._decided(model, version, digest, status, rest)

    async def restore(self, model: str, version: int, digest: str, manifest: str, retain: int) -> bool:
        args: list[str | int] = [model, version, digest, manifest, retain]
        out = await self._call(f"restoring {subject(model, version)}",
                               self._restore(keys=self._keys(model), args=args))
        status, *rest = [x.decode() if isinstance(x, bytes) else str(x) for x in out]
        if status == "conflict":
            raise conflict(model, version, rest[0], digest)
        return status == "held"

    async def withdraw_part(self, model: str, version: int, owner: str, owners: Sequence[str] = ()) -> bool:
        out = await self._call(f"withdrawing replica {owner!r}'s part of {subject(model, version)}",
                               self._withdraw_part(keys=self._keys(model, version, owners),
                                                   args=[version, owner]))
        return bool(int(out))

    async def part_pending(self, model: str, version: int, owner: str, owners: Sequence[str]) -> bool:
        pending = self._keys(model, version, owners)[-1]
        return bool(await self._call(f"reading the parts of {subject(model, version)}",
                                     self._redis.hexists(pending, owner)))

    async def versions(self, model: str) -> list[int]:
        raw = await self._call(f"listing model {model!r}", self._redis.zrange(self._key(model, "versions"), 0, -1))
        return sorted(int(v) for v in raw)  # type: ignore[attr-defined]

    async def manifest(self, model: str, version: int) -> str | None:
        raw = await self._call(f"reading {subject(model, version)}",
                               self._redis.hget(self._key(model, "manifests"), str(version)))
        return raw.decode() if isinstance(raw, bytes) else None

    async def models(self) -> list[str]:
        raw = await self._call("listing models", self._redis.smembers(f"{self.prefix}:models"))
        return sorted(m.decode() for m in raw)  # type: ignore[attr-defined]

    async def events(self, model: str, after: int) -> AsyncIterator[int]:
        """Retained versions above `after`, then each new one from the model's stream (XREAD BLOCK)."""
        stream = self._key(model, "events")
        info = await self._call(f"watching model {model!r}", self._redis.xrevrange(stream, count=1))
        cursor = info[0][0] if info else b"0-0"  # type: ignore[index]
        last = after
        for v in await self.versions(model):
            if v > last:
                yield v
                last = v
        while True:
            read = self._redis.xread({stream: cursor}, block=self._block_ms)
            got = await self._call(f"watching model {model!r}", read)
            for _, entries in got or []:  # type: ignore[attr-defined]
                for entry_id, fields in entries:
                    cursor = entry_id
                    v = int(fields[b"version"])
                    if v > last:
                        yield v
                        last = v

    @functools.cached_property
    def _ack(self) -> Any:
        return self._redis.register_script(_ACK)

    async def ack(self, model: str, client_id: str, version: int, unix: float, caller: str, keep_s: float) -> bool:
        keys = [self._key(model, "acks"), self._key(model, "ack_times")]
        args = [client_id, json.dumps([version, unix, caller]), caller, unix, unix - keep_s, ACKS_KEPT,
                max(1, int(keep_s * 1000))]
        return bool(await self._call(f"acking model {model!r}", self._ack(keys=keys, args=args)))

    async def acks(self, model: str) -> dict[str, tuple[int, float]]:
        raw = await self._call(f"reading the acks of model {model!r}", self._redis.hgetall(self._key(model, "acks")))
        return {k.decode(): tuple(json.loads(v)[:2]) for k, v in raw.items()}  # type: ignore[attr-defined,misc]

    @functools.cached_property
    def _add_mismatch(self) -> Any:
        return self._redis.register_script(_ADD_MISMATCH)

    async def add_mismatch(self, model: str, added: Mapping[int, MismatchRecord], keep: Sequence[int]
                           ) -> dict[int, MismatchRecord]:
        args: list[Any] = [json.dumps([str(v) for v in keep]), MAX_TOKENS]
        for v, r in added.items():
            args += [v, r.tokens, repr(r.abs_logp_delta), repr(r.k3_kl), repr(r.outside_band),
                     "" if r.step is None else r.step, _band_text(r.band)]
        totals = await self._call(f"recording the mismatch of model {model!r}",
                                  self._add_mismatch(keys=[self._key(model, "mismatch")], args=args))
        if totals and totals[0] == b"band":
            had = dict(zip(totals[1::2], totals[2::2], strict=True))
            raise band_conflict(model, {int(v): (_band(b), added[int(v)].band) for v, b in had.items()})
        if totals and totals[0] == b"overflow":
            raise totals_overflow(model, [int(v) for v in totals[1:]])
        return {v: _record(tokens, abs_sum, k3_sum, outside, step, _band_text(r.band))
                for (v, r), (tokens, abs_sum, k3_sum, outside, step) in zip(added.items(), totals, strict=True)}

    async def mismatch(self, model: str) -> dict[int, MismatchRecord]:
        raw = await self._call(f"reading the mismatch of model {model!r}",
                               self._redis.hgetall(self._key(model, "mismatch")))
        fields: dict[int, dict[str, str]] = {}
        for k, value in raw.items():
            version, _, field = k.decode().partition(":")
            fields.setdefault(int(version), {})[field] = value.decode()
        return {v: _record(f["tokens"], f.get("abs", 0), f.get("k3", 0), f.get("outside", 0), f.get("step"),
                           f.get("band"))
                for v, f in fields.items() if "tokens" in f}

    async def register(self, replica: Replica, ttl: float = REPLICA_TTL_S) -> bool:
        key = f"{self.prefix}:replica:{replica.id}"
        async with self._redis.pipeline(transaction=True) as pipe:
            pipe.exists(key)
            pipe.set(key, json.dumps(dataclasses.asdict(replica)), px=int(ttl * 1000))
            pipe.sadd(f"{self.prefix}:replicas", replica.id)
            renewed, _, _ = await self._call(f"registering replica {replica.id!r}", pipe.execute())
        return bool(renewed)

    async def deregister(self, replica_id: str) -> None:
        async with self._redis.pipeline(transaction=True) as pipe:
            pipe.delete(f"{self.prefix}:replica:{replica_id}")
            pipe.srem(f"{self.prefix}:replicas", replica_id)
            await self._call(f"deregistering replica {replica_id!r}", pipe.execute())

    async def replicas(self) -> list[Replica]:
        """The live replicas; ones whose registration expired are dropped from the set."""
        members = await self._call("listing replicas", self._redis.smembers(f"{self.prefix}:replicas"))
        ids = sorted(m.decode() for m in members)
        if not ids:
            return []
        raw = await self._call("listing replicas", self._redis.mget([f"{self.prefix}:replica:{i}" for i in ids]))
        live, gone = [], []
        for replica_id, value in zip(ids, raw, strict=True):
            if value is None:
                gone.append(replica_id)
            else:
                live.append(Replica(**json.loads(value)))
        if gone:
            await self._call("pruning replicas", self._redis.srem(f"{self.prefix}:replicas", *gone))
        return live

    async def close(self) -> None:
        await self._redis.aclose()
