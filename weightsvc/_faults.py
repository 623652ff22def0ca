"""Crash points for the recovery tests: with `WEIGHTSVC_CRASH_AT=<point>` the process kills itself
with SIGKILL when it reaches that point, as a power cut would there. Unset, a point costs one string
comparison. The points are where a commit changes what is on disk or visible."""

from __future__ import annotations

import os
import signal

CRASH_AT = os.environ.get("WEIGHTSVC_CRASH_AT", "")
POINTS = (
    "commit.residual-written",  # the new ef residual is on disk, the version file is not
    "commit.version-written",  # the version's temporary file is complete and synced, not renamed
    "commit.version-renamed",  # the version file is in place; the registry has not committed it
    "commit.visible",  # committed and visible; the learner has not had its answer
)


def crash_point(name: str) -> None:
    if name == CRASH_AT:
        os.kill(os.getpid(), signal.SIGKILL)
