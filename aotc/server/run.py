"""Running aotc serve: the Session, its service, the app under uvicorn, and the drain.

SIGTERM (or Ctrl-C) starts a drain instead of uvicorn's own shutdown: /health and new
requests get 503, requests that have not taken a slot end with 503, running ones go on
to their end for at most --shutdown-timeout seconds; then the process exits, 0 where
every request ended, 1 where the deadline cut streams (each gets an error event). A
second signal exits at once.
"""

from __future__ import annotations

import asyncio
import logging
import signal
import time

import uvicorn

from ..errors import AotcError

log = logging.getLogger("aotc.serve")


def serve(session, *, name: str, host: str, port: int, api_keys: list[str], max_queue: int, shutdown_timeout: float, prefix_cache: bool = True, ready=None) -> int:
    """Serve `session` until a signal ends it; the exit status. ready(): called once the
    socket listens (the CLI prints the address)."""
    from .app import Server

    service = session.service(max_waiting=max_queue, prefix_cache=prefix_cache)
    server = Server(session, service, name, api_keys)
    config = uvicorn.Config(server.app, host=host, port=port, log_level="warning", access_log=False, lifespan="off", timeout_graceful_shutdown=1)
    drainer = Draining(config, server, shutdown_timeout, ready)
    try:
        asyncio.run(drainer.serve())
    finally:
        try:
            service.close(timeout=0)
        except AotcError:
            pass
    return 1 if server.cut else 0


class Draining(uvicorn.Server):
    """uvicorn's server, whose first SIGTERM or SIGINT starts aotc's drain."""

    def __init__(self, config, server, timeout: float, ready):
        super().__init__(config)
        self.app_server, self.timeout, self.ready = server, timeout, ready
        self.loop = self.drain_task = None

    async def startup(self, sockets=None):
        await super().startup(sockets)
        self.loop = asyncio.get_running_loop()
        if self.ready is not None and self.started:
            host, port = self.servers[0].sockets[0].getsockname()[:2]
            self.ready(f"{host}:{port}")

    def handle_exit(self, sig, frame):
        if sig in (signal.SIGTERM, signal.SIGINT) and self.drain_task is None and self.loop is not None:
            self.app_server.draining = True
            self.app_server.service.shed()
            self.drain_task = self.loop.call_soon_threadsafe(lambda: self.loop.create_task(self.drain()))
            return
        super().handle_exit(sig, frame)  # before startup, or a second signal: exit now

    async def drain(self):
        # Polled: requests end on the engine thread and in their handlers, and a tenth of
        # a second is nothing against a drain's seconds.
        deadline = time.monotonic() + self.timeout
        while self.app_server.in_flight and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        if self.app_server.in_flight:
            self.app_server.cut = True
            log.warning("shutdown: %d requests still ran after %g s; ending them", len(self.app_server.in_flight), self.timeout)
            for handle in list(self.app_server.in_flight):
                handle.abort()
            cut_at = time.monotonic()
            while self.app_server.in_flight and time.monotonic() < cut_at + CUT_GRACE:  # their error events go out
                await asyncio.sleep(0.05)
        self.should_exit = True


CUT_GRACE = 5.0  # s: at most this for aborted streams to send their error event
