"""The verl tests need verl (and Ray), which live in an environment of their own (scripts/setup_verl.sh).
Elsewhere they are not collected; with WEIGHTSVC_VERL=1 (scripts/test_verl.sh) a missing verl is an
error, never a skip."""

import importlib.util
import os

if os.environ.get("WEIGHTSVC_VERL") == "1":
    import verl  # noqa: F401  (fails loudly where the verl tests must run)

    collect_ignore_glob: list[str] = []
else:
    collect_ignore_glob = [] if importlib.util.find_spec("verl") else ["test_*.py"]
