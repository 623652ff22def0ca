"""The real-engine tests need vLLM, which lives in an environment of its own (scripts/setup_engines.sh).
Elsewhere they are not collected; with WEIGHTSVC_ENGINES=1 (scripts/test_engines.sh) a missing vLLM
is an error, never a skip."""

import importlib.util
import os

if os.environ.get("WEIGHTSVC_ENGINES") == "1":
    import vllm  # noqa: F401  (fails loudly where the engine tests must run)

    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")  # GiB of KV cache per engine: tiny models
    collect_ignore_glob: list[str] = []
else:
    collect_ignore_glob = [] if importlib.util.find_spec("vllm") else ["test_*.py"]
