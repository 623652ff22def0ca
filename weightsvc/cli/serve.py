"""`weightsvc serve`: the service in the foreground, its flags generated from `Settings`."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import typer

from weightsvc.cli._common import fail
from weightsvc.errors import WeightsvcError

if TYPE_CHECKING:
    from weightsvc.settings import Settings


def serve(settings: Settings) -> None:
    """Run the service (gRPC + HTTP) on the embedded default: in-memory registry, CPU export."""
    import asyncio
    import gc
    import logging
    import signal

    from weightsvc._log import configure_logging
    from weightsvc.server.server import Server

    configure_logging(settings.log_level)

    async def run() -> None:
        server = Server(settings)
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, stop.set)
        await server.start()
        # A push of 100,000 tensors makes millions of objects, and each full collection of the
        # cyclic GC (which holds the GIL, so the event loop, for 0.3 s and more) walks all of them:
        # collect the oldest generation 100 times less often, and never walk what start-up loaded.
        gc.freeze()
        gc.set_threshold(700, 10, 1000)
        # One machine-readable line on stdout, for scripts that started us with port 0.
        print(f"weightsvc ready grpc={server.grpc_target} http={server.http_url} "
              f"probes={server.probe_url} device={server.device}", flush=True)
        await stop.wait()
        logging.getLogger("weightsvc").info("shutting down")
        await server.stop()

    try:
        asyncio.run(run())
    except OSError as e:
        fail(str(e))
    except WeightsvcError as e:  # a setting that cannot be had here (--device cuda without a GPU)
        fail(e.message)


_SERVE_EPILOG = (
    "Every flag can also be set by its WEIGHTSVC_* variable; a flag wins over its variable. Bearer tokens "
    "come from WEIGHTSVC_PULL_TOKENS, WEIGHTSVC_PUSH_TOKENS and WEIGHTSVC_ADMIN_TOKENS (comma-separated) "
    "or --auth-file, never from flags."
)


def click_command() -> Any:
    """The `serve` command, built from `Settings` (the command group asks for it by name)."""
    from weightsvc.cli.flags import settings_command

    one = typer.Typer(add_completion=False, pretty_exceptions_enable=False)
    one.command("serve", epilog=_SERVE_EPILOG)(settings_command(serve))
    return typer.main.get_command(one)
