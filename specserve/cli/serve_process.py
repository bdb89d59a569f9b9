"""`specserve serve` as a child process on free ports, read up to its ready banner: what the
tests that serve through the CLI and the benchmarks that measure the served stack (the OpenAI API
beside Triton, as a user runs it) share."""

from __future__ import annotations

import contextlib
import re
import signal
import subprocess
import threading
import time
from dataclasses import dataclass, field
from typing import Iterator

from specserve.triton.launch import PORT_RETRIES, PORT_TAKEN, Ports
from specserve.triton.parent_death import die_with_parent

READY = "specserve: ready"


class ServeProcessError(RuntimeError):
    """serve did not get ready, or did not print what was waited for; the message ends with its output."""


@dataclass
class ServeProcess:
    """A running `specserve serve`, its output read up to and including the ready banner."""

    proc: subprocess.Popen
    ports: Ports
    output: list[str]
    _reader: threading.Thread | None = field(default=None, repr=False)

    def next_lines(self, n: int) -> str:
        lines = [next(self.proc.stdout) for _ in range(n)]
        self.output += lines
        return "".join(lines)

    def openai_port(self, timeout: float = 300) -> int:
        """The port that `--openai-port 0` bound, from the line serve prints for it."""
        line = self.read_until("  OpenAI   http://", timeout)
        return int(re.search(r":(\d+)/v1", line).group(1))

    def read_until(self, marker: str, timeout: float = 300) -> str:
        deadline = time.monotonic() + timeout
        for line in self.proc.stdout:
            self.output.append(line)
            if marker in line:
                return line
            if time.monotonic() > deadline:
                break
        raise ServeProcessError(f"no {marker!r} in the output of specserve serve:\n" + self.tail(30))

    def keep_reading(self) -> None:
        """Read the rest of the output on a daemon thread, so that a long-running server never
        blocks on a full pipe (its lines still land in `output`)."""
        self._reader = threading.Thread(target=lambda: self.output.extend(self.proc.stdout), daemon=True)
        self._reader.start()

    def stop(self, timeout: float = 60) -> int:
        """SIGTERM (docker stop, Kubernetes): serve drains, stops tritonserver and exits; the rest
        of its output is read meanwhile (see tail())."""
        self.proc.send_signal(signal.SIGTERM)
        if self._reader is not None:
            self.proc.wait(timeout=timeout)
            self._reader.join(timeout)
            return self.proc.returncode
        rest, _ = self.proc.communicate(timeout=timeout)
        self.output += rest.splitlines(keepends=True)
        return self.proc.returncode

    def tail(self, n: int = 40) -> str:
        return "".join(self.output[-n:])


def _lost_a_port(lines: list[str]) -> bool:
    """Did this start lose a port to another process? Our own check (`port N is already in use`)
    or tritonserver's bind errors (launch.PORT_TAKEN)."""
    return any(p in line for line in lines for p in PORT_TAKEN)


@contextlib.contextmanager
def serve_process(command: list[str], *args: str, cwd=None, env=None,
                  ready_timeout: float = 300) -> Iterator[ServeProcess]:
    """`command serve ARGS` (command: `[sys.executable, "-m", "specserve.cli.main"]`, or an
    installed `specserve` script) on free HTTP / gRPC / metrics ports, yielded as a ServeProcess
    once it prints its ready banner. A probed free port can be taken before the server binds it:
    a start that fails, or comes up, having lost one, is stopped and made again on fresh ports
    (launch.PORT_RETRIES times), so nothing depends on port luck. Killed on exit if still running."""
    for _ in range(PORT_RETRIES + 1):
        ports = Ports.free()
        # SIGTERM (serve drains and stops its tritonserver) if this process dies without exiting
        # the with block: a peer's segfault in a benchmark left servers running before.
        proc = subprocess.Popen(die_with_parent([*command, "serve", *args, "--http-port", str(ports.http),
                                                 "--grpc-port", str(ports.grpc), "--metrics-port",
                                                 str(ports.metrics)], signal.SIGTERM),
                                stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd=cwd, env=env)
        try:
            lines, deadline = [], time.monotonic() + ready_timeout
            for line in proc.stdout:
                lines.append(line)
                if line.startswith(READY) or time.monotonic() > deadline:
                    break
            ready = bool(lines) and lines[-1].startswith(READY)
            if _lost_a_port(lines):
                continue
            if not ready:
                raise ServeProcessError("specserve serve did not get ready:\n" + "".join(lines[-30:]))
            yield ServeProcess(proc, ports, lines)
            return
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    raise ServeProcessError(f"specserve serve lost a port {PORT_RETRIES + 1} times in a row:\n" + "".join(lines[-30:]))
