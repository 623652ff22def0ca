"""A reader process of the NIXL tests: `InferenceClient(TARGET).pull_into(...)` of a version into
tensors it preallocates from the manifest, saved to OUT (torch.save) when the pull succeeds.

    python -m tests.integration.nixl_reader TARGET MODEL VERSION OUT [--select NAME@DIM:START:STOP ...]
        [--lease-s S] [--wait] [--no-fallback] [--base B [--base-unread]]

With --wait it prints `leased V S` once the server lent the version (S: the lease's seconds) and reads
only after a line on stdin. With --die-mid-read it prints the same line, then kills itself (SIGKILL)
as soon as its READ is posted, its lease still held. With --pause-mid-read it prints the same line,
then `reading` once its first READ is posted, and waits for a line on stdin before it looks at it.
With --base it first reads version B whole into its tensors, then VERSION as a delta on it (with
--base-unread it claims to hold B but holds zeros). Its last line is `ok V` or `error CODE MESSAGE`;
its log (stderr) says where it moved when a source failed. --piece-bytes N: its READs go N bytes at a time.
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
from typing import Any

import torch

from weightsvc import InferenceClient
from weightsvc.client import _nixl
from weightsvc.client._tensors import TORCH_DTYPES
from weightsvc.errors import WeightsvcError
from weightsvc.protocol.fabric import Lease, nixl_agent_class
from weightsvc.protocol.selection import parse_selector, selection, sliced_shape


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("target")
    parser.add_argument("model")
    parser.add_argument("version")
    parser.add_argument("out")
    parser.add_argument("--select", nargs="*", default=None)
    parser.add_argument("--lease-s", type=float, default=60.0)
    parser.add_argument("--wait", action="store_true")
    parser.add_argument("--no-fallback", action="store_true")
    parser.add_argument("--die-mid-read", action="store_true")
    parser.add_argument("--pause-mid-read", action="store_true")
    parser.add_argument("--base", type=int, default=None)
    parser.add_argument("--base-unread", action="store_true")
    parser.add_argument("--piece-bytes", type=int, default=None)
    args = parser.parse_args()
    if args.piece_bytes is not None:
        _nixl.PIECE = args.piece_bytes
    client = InferenceClient(args.target)
    select = selection(map(parse_selector, args.select)) if args.select else None
    manifest = client.manifest(args.model, args.version)
    wanted = select if select is not None else {t.name: None for t in manifest.tensors}
    by_name = {t.name: t for t in manifest.tensors}
    tensors = {name: torch.zeros(sliced_shape(by_name[name].shape, cut), dtype=TORCH_DTYPES[by_name[name].dtype])
               for name, cut in wanted.items()}
    if args.wait or args.die_mid_read or args.pause_mid_read:
        lease = client._lease

        def lease_then_wait(*a: Any) -> Lease:
            lent = lease(*a)
            print(f"leased {lent.manifest.version} {lent.lease_s}", flush=True)
            if args.wait:
                sys.stdin.readline()
            return lent

        client._lease = lease_then_wait  # type: ignore[method-assign]
    if args.die_mid_read:
        agent = nixl_agent_class()
        transfer = agent.transfer

        def transfer_then_die(self: Any, *a: Any) -> str:
            state: str = transfer(self, *a)
            os.kill(os.getpid(), signal.SIGKILL)
            return state

        agent.transfer = transfer_then_die
    if args.pause_mid_read:
        agent = nixl_agent_class()
        transfer = agent.transfer
        paused: list[bool] = []

        def transfer_then_pause(self: Any, *a: Any) -> str:
            state: str = transfer(self, *a)
            if not paused:
                paused.append(True)
                print("reading", flush=True)
                sys.stdin.readline()
            return state

        agent.transfer = transfer_then_pause
    try:
        if args.base is not None and not args.base_unread:
            client.pull_into(tensors, args.model, args.base, fallback=False)
        got = client.pull_into(tensors, args.model, manifest.version, select=select, base=args.base,
                               fallback=not args.no_fallback, lease_s=args.lease_s)
    except WeightsvcError as e:
        print(f"error {e.grpc_code} {e.message}", flush=True)
        sys.exit(3)
    torch.save(tensors, args.out)
    print(f"ok {got.version}", flush=True)


if __name__ == "__main__":
    main()
