"""One server's lifetime: the REST app, the gRPC services and the JSON workers, started and
stopped together.

The REST application (``rest``) and the gRPC services (``grpc_server``) share one
``ServingCore`` on one asyncio loop, so both ports feed one batching queue. The gRPC services and
the JSON workers start when the REST app starts (its lifespan) and stop when it stops, so there
is one place that starts and stops the transports: this module.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Callable, Sequence

from fastapi import FastAPI

from estimax.serving import bodies, rest, transport
from estimax.serving.core import ServingCore
from estimax.serving.manager import ModelManager
from estimax.serving.options import ServerOptions

__all__ = ["Server"]


class Server:
    """The models' front end: ``app`` (ASGI: REST), and gRPC on ``options.grpc_port``."""

    def __init__(self, manager: ModelManager | Sequence[ModelManager], options: ServerOptions):
        """Builds the app; ``manager`` (one per model) loads and swaps versions (started by the
        caller)."""
        self.core = ServingCore(manager, options)
        self.options = options
        # Called when the server stops, before the models' managers stop (the config poller).
        self.on_stop: list[Callable[[], None]] = []
        self.bodies = bodies.JsonWorkers(options.json_workers or bodies.WORKERS)
        self.app = rest.build_app(self.core, self.bodies, self._lifespan)
        # What a connection past --max_connections is answered when none could make room.
        self.refuse_app = rest.refused_app(self.core)

    @contextlib.asynccontextmanager
    async def _lifespan(self, app: FastAPI) -> AsyncIterator[None]:
        grpc = None
        if self.options.grpc_port:
            from estimax.serving import grpc_server  # grpcio only when gRPC is asked for

            grpc = await grpc_server.start(
                self.core, self.options.grpc_host, self.options.grpc_port
            )
        # The JSON workers start in the background: the first large body need not wait for them.
        asyncio.get_running_loop().run_in_executor(None, self.bodies.start)
        try:
            yield
        finally:
            self.bodies.close()
            if grpc is not None:
                await grpc.stop(grace=5)

    def run_grpc_only(self) -> None:
        """Serves gRPC alone (TF Serving's ``--rest_api_port=0``) until SIGINT or SIGTERM."""
        import signal

        async def serve() -> None:
            stop = asyncio.Event()
            loop = asyncio.get_running_loop()
            for signum in (signal.SIGINT, signal.SIGTERM):
                loop.add_signal_handler(signum, stop.set)
            async with self._lifespan(self.app):
                await stop.wait()

        try:
            asyncio.run(serve())
        finally:
            self._stop()

    def run(self, host: str, port: int, log_level: str) -> None:
        """Serves on ``host:port`` (and gRPC) until interrupted; stops the manager after."""
        import uvicorn

        http = transport.protocol_class(
            self.options.limits,
            on_close=self.core.metrics.connection_closed,
            refuse_app=self.refuse_app,
        )
        try:
            uvicorn.run(
                self.app,
                host=host,
                port=port,
                log_level=log_level,
                access_log=False,
                http=http,
                # uvicorn types it int; it hands the seconds to loop.call_later, which takes a
                # float (the flag's fractional seconds are kept).
                timeout_keep_alive=self.options.limits.keep_alive_timeout_s,  # type: ignore[arg-type]
            )
        finally:
            self._stop()

    def _stop(self) -> None:
        """Stops what polls: the config file's poller, then every model's manager."""
        for stop in self.on_stop:
            stop()
        for model in self.core.models.values():
            model.manager.stop()
