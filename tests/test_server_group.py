"""A tritonserver that aborts leaves nothing running: TritonServer kills what is left of its
process group (its Python-backend stubs), whether the abort comes before ready (wait_ready) or
after (stop). A shell script stands in for the server: it starts a long child, as tritonserver
starts a stub per model, writes the child's pid, and aborts itself (SIGABRT, code -6, as a
tritonserver that hit boost::interprocess::lock_exception at start did)."""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from specserve.triton.launch import Ports, ServerStartError, TritonServer

ABORTS = 'sleep 600 & echo $! > "$1"; while [ ! -e "$2" ]; do sleep 0.1; done; kill -ABRT $$'


class AbortingServer(TritonServer):
    """Runs ABORTS instead of tritonserver; it aborts once `go` exists."""
    script_args: tuple[str, str] = ("", "")

    def command(self) -> list[str]:
        return ["bash", "-c", ABORTS, "server", *self.script_args]


def alive(pid: int) -> bool:
    """Running, not a zombie waiting for its (re)parent to reap it."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().split(")")[-1].split()[0] != "Z"
    except FileNotFoundError:
        return False


def wait_for(predicate, what: str, limit_s: float = 120.0) -> None:
    """Polls an event that must come (a file written, a process gone); the limit only stops a
    test that would otherwise hang, it is not what the test measures."""
    deadline = time.monotonic() + limit_s
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"{what}: not after {limit_s:.0f} s")
        time.sleep(0.05)


def start(tmp_path: Path) -> tuple[AbortingServer, Path, Path]:
    pid_file, go = tmp_path / "stub.pid", tmp_path / "go"
    server = AbortingServer(tmp_path, tmp_path, ports=Ports(1, 2, 3), log_file=tmp_path / "server.log")
    server.script_args = (str(pid_file), str(go))
    server.start()
    wait_for(lambda: pid_file.exists() and pid_file.read_text().strip(), "the stand-in stub's pid")
    return server, int(pid_file.read_text()), go


@pytest.mark.skipif(not Path("/proc/self/stat").exists(), reason="reads process states from /proc")
def test_a_server_that_aborts_before_ready_leaves_no_stub(tmp_path):
    server, stub, go = start(tmp_path)
    assert alive(stub)
    go.touch()
    with pytest.raises(ServerStartError, match=r"^tritonserver exited with code -6 before it was ready"):
        server.wait_ready(timeout=120)
    wait_for(lambda: not alive(stub), "the stub killed")


@pytest.mark.skipif(not Path("/proc/self/stat").exists(), reason="reads process states from /proc")
def test_stop_after_an_abort_kills_the_stub_it_left(tmp_path):
    server, stub, go = start(tmp_path)
    go.touch()
    wait_for(lambda: server.process.poll() is not None, "the stand-in server's abort")
    assert alive(stub)                       # the abort alone leaves it, as tritonserver's did
    assert server.stop() == -6
    wait_for(lambda: not alive(stub), "the stub killed")


def test_stop_of_a_server_never_started_is_none(tmp_path):
    assert TritonServer(tmp_path, tmp_path, ports=Ports(1, 2, 3)).stop() is None
