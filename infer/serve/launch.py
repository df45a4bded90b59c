"""A server inside this process (a uvicorn thread over a started ``Service``), for the serving benchmark and for
programs that embed one; ``python -m infer.serve`` is the standalone form."""
from __future__ import annotations

import socket
import threading
import time

import uvicorn

from infer.serve.app import create_app
from infer.serve.service import Service


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


class Running:
    """``service`` served on http://``host``:``port`` (a free port when 0) until ``stop()``; a context manager."""

    def __init__(self, service: Service, host: str = "127.0.0.1", port: int = 0, warm: bool = True):
        self.service, self.host, self.port = service, host, port or free_port(host)
        if not service.scheduler.alive:
            service.start(warm=warm)
        config = uvicorn.Config(create_app(service, manage=False), host=host, port=self.port, log_level="warning",
                                timeout_graceful_shutdown=5)
        self.server = uvicorn.Server(config)
        self.thread = threading.Thread(target=self.server.run, name="dflash-http", daemon=True)
        self.thread.start()
        deadline = time.monotonic() + 60
        while not self.server.started:
            if not self.thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError(f"the server did not start on {host}:{self.port}")
            time.sleep(0.02)

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}/v1"

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(30)
        self.service.stop(drain=False, timeout=30)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.stop()
