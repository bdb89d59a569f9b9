"""uvicorn serving the OpenAI app on a socket bound here (port 0 picks a free one, and an address
in use fails at once, before anything starts), in the foreground or on a thread beside
`specserve serve`."""

from __future__ import annotations

import socket
import threading
from dataclasses import dataclass
from pathlib import Path


@dataclass
class OpenAIServer:
    server: object          # uvicorn.Server
    sock: socket.socket
    thread: threading.Thread | None = None

    @property
    def port(self) -> int:
        return self.sock.getsockname()[1]

    def run(self) -> None:
        """In the foreground, until Ctrl-C."""
        self.server.run(sockets=[self.sock])

    def start(self) -> "OpenAIServer":
        """On a daemon thread (uvicorn installs no signal handlers off the main thread)."""
        self.thread = threading.Thread(target=self.run, name="specserve-openai", daemon=True)
        self.thread.start()
        return self

    def stop(self, timeout: float = 10.0) -> None:
        self.server.should_exit = True
        if self.thread is not None:
            self.thread.join(timeout)
        self.sock.close()


def make_server(url: str, port: int, checkpoint: str | Path, max_model_len: int, host: str = "127.0.0.1",
                log_level: str = "warning") -> OpenAIServer:
    """The OpenAI API for the `llm` ensemble at gRPC `url`, serving `checkpoint` (as served, with
    this max_model_len). Raises OSError when the address cannot be bound."""
    import uvicorn

    from specserve.openai.app import OpenAIService, make_app
    from specserve.openai.backend import ServedModel, TritonBackend
    from specserve.openai.chat import ChatTemplate

    served = ServedModel(Path(checkpoint), max_model_len)
    service = OpenAIService(TritonBackend(url), served, ChatTemplate(served.checkpoint))
    sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError:
        sock.close()
        raise
    sock.listen(128)
    config = uvicorn.Config(make_app(service), log_level=log_level, timeout_graceful_shutdown=5)
    return OpenAIServer(uvicorn.Server(config), sock)
