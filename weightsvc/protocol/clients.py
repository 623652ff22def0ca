"""An inference client as its acks describe it: what the server keeps of each one, and what it
answers to ListClients and `/v1/models/{model}/clients`."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class ClientStatus:
    """An inference client of a model, as its acks left it."""

    client_id: str
    version: int  # the version it acked last
    lag_versions: int  # committed versions newer than that one
    last_seen_unix: float
    connected: bool  # acked within the server's client timeout; older clients count as gone
