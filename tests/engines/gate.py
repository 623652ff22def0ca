"""A gate on a request's decode steps, for tests that hold a request in flight whatever the machine's
speed. `StepGate` is a vLLM logits processor (a server started with `--logits-processors
tests.engines.gate:StepGate`): a request whose sampling parameters carry `extra_args={"gate": PATH}`
samples no more tokens than the number PATH holds, waiting in the engine's step until the test allows
more (`Gate`); other requests pass untouched. The engine takes a pause between two steps, so a test that
pauses a held request lets its steps through one at a time until the pause is taken (`Gate.pause`).
The engine imports this module: it imports vLLM and torch alone."""

from __future__ import annotations

import os
import threading
import time
import urllib.request
from pathlib import Path
from typing import Any

import torch
from vllm.v1.sample.logits_processor import BatchUpdate, LogitsProcessor, MoveDirectionality

CLASS = "tests.engines.gate:StepGate"  # `--logits-processors` of a server that gates


class StepGate(LogitsProcessor):
    def __init__(self, vllm_config: Any, device: torch.device, is_pin_memory: bool) -> None:
        self.gated: dict[int, tuple[Path, list[int]]] = {}  # batch row -> (gate, the request's output tokens)

    def is_argmax_invariant(self) -> bool:
        return False  # (vLLM skips `apply` for greedy requests otherwise)

    def update_state(self, batch_update: BatchUpdate | None) -> None:
        if batch_update is None:
            return
        for row in batch_update.removed:
            self.gated.pop(row, None)
        for row, params, _, output in batch_update.added:
            gate = (params.extra_args or {}).get("gate") if params is not None else None
            if gate:
                self.gated[row] = (Path(gate), output)
            else:
                self.gated.pop(row, None)
        for a, b, direction in batch_update.moved:
            at_a, at_b = self.gated.pop(a, None), self.gated.pop(b, None)
            if at_a is not None:
                self.gated[b] = at_a
            if at_b is not None and direction == MoveDirectionality.SWAP:
                self.gated[a] = at_b

    def apply(self, logits: torch.Tensor) -> torch.Tensor:
        for gate, output in list(self.gated.values()):
            while len(output) >= int(gate.read_text()):
                time.sleep(0.001)  # (the engine's step waits on the test: nothing to block on across processes)
        return logits


class Gate:
    """The test's side: how many tokens the gated request may have."""

    def __init__(self, path: Path, tokens: int) -> None:
        self.path = path
        self.tokens = 0
        self.held = 0  # the tokens the request was let have until the pause was taken
        self.allow(tokens)

    @property
    def args(self) -> dict[str, str]:
        """The sampling parameters' `extra_args` of a gated request."""
        return {"gate": str(self.path)}

    def allow(self, tokens: int) -> None:
        self.tokens = tokens
        partial = self.path.with_suffix(".partial")
        partial.write_text(str(tokens))
        os.replace(partial, self.path)  # (the engine never reads a half-written number)

    def open(self) -> None:
        self.allow(1 << 30)

    def pause(self, engine_url: str) -> None:
        """vLLM's `keep` pause with the gated request in flight. The engine takes a pause once its step
        ends, so the request is let one token further at a time until the pause is taken; then the gate
        opens (the pause holds the request from there, and an engine held in a step would answer nothing
        else)."""
        failed: list[BaseException] = []

        def pause() -> None:
            request = urllib.request.Request(f"{engine_url}/pause?mode=keep", method="POST")
            try:
                urllib.request.urlopen(request, timeout=120).close()
            except BaseException as e:  # (raised in the test's thread below)
                failed.append(e)

        pausing = threading.Thread(target=pause)
        pausing.start()
        try:
            pausing.join(0.05)
            while pausing.is_alive():
                self.allow(self.tokens + 1)
                pausing.join(0.05)
        finally:
            self.held = self.tokens
            self.open()
        if failed:
            raise failed[0]
