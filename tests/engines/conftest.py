"""The real-engine tests need vLLM, which lives in an environment of its own (scripts/setup_engines.sh).
Elsewhere they are not collected; with WEIGHTSVC_ENGINES=1 (scripts/test_engines.sh) a missing vLLM
is an error, never a skip."""

import importlib.util
import os

if os.environ.get("WEIGHTSVC_ENGINES") == "1":
    import vllm  # noqa: F401  (fails loudly where the engine tests must run)

    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")  # GiB of KV cache per engine: tiny models
    # An engine's workers are stopped with SIGTERM once this grace has passed (5 s by default): its
    # worker is done with by then, and every engine a test starts would wait it out.
    os.environ.setdefault("VLLM_WORKER_SHUTDOWN_TIMEOUT_SECONDS", "1")
    collect_ignore_glob: list[str] = []
else:
    collect_ignore_glob = [] if importlib.util.find_spec("vllm") else ["test_*.py"]
