"""What the transports use of uvicorn, asyncio, grpcio and Linux beyond their public APIs is still there:
an upgrade that takes one away fails here, naming it."""

from __future__ import annotations

import pytest

from weightsvc.transport import _internals


def test_the_installed_libraries_still_have_what_the_transports_reach_into() -> None:
    assert _internals.missing() == []


def test_a_missing_attribute_is_named(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delattr(_internals._SELECTOR_TRANSPORT, "_make_empty_waiter")
    assert _internals.missing() == ["asyncio _SelectorSocketTransport._make_empty_waiter()"]
