"""Start and stop a real `tritonserver`: find the binary, prepare its backends, wait for ready.

Shared by `specserve serve`, `make demo` and the Triton tests, so the four things the CPU build
needs (docs/design.md, 'Running Triton on CPU') are written down once:

  1. the Python backend stub for this interpreter next to `libtriton_python.so` in the backend
     directory we pass (a private copy: never write into site-packages);
  2. numpy<2 in the stub's environment (the package pins it);
  3. this interpreter's LIBDIR first on LD_LIBRARY_PATH, or the stub loads the system libpython
     and C extensions such as `_ssl` fail to import; then the wheel's `nvidia_pytriton.libs`,
     which the copied stub's RPATH ($ORIGIN/../../../../nvidia_pytriton.libs) no longer reaches;
  4. this interpreter's bin folder (the venv's) first on PATH, so the stub's Python finds the
     venv's site-packages, where specserve is installed.

In the NGC container `/opt/tritonserver` exists and carries its own backends and stub; we use it
as it is.

Ports: a probed free port can be taken by another process before tritonserver binds it (tests
start several servers at once). A TritonServer made without ports picks free ones and, when the
server exits because one was taken meanwhile, starts again on fresh ones; one made with fixed
ports (`specserve serve`) reports the clash.

Every server closes Triton's administrative endpoints to ordinary clients (auth.py): the admin
key is the server's `admin_key`, sent as a header by `specserve drafters` and the tests.
"""

from __future__ import annotations

import fcntl
import os
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import sysconfig
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

from specserve.serving.auth import grpc_headers, new_key, restricted_api_args
from specserve.triton.parent_death import die_with_parent

NGC_ROOT = Path("/opt/tritonserver")


class ServerStartError(RuntimeError):
    """tritonserver could not be started or did not become ready."""


def _pytriton_root() -> Path:
    try:
        import pytriton
    except ImportError:
        raise ServerStartError("no tritonserver: /opt/tritonserver is absent and the nvidia-pytriton "
                               "package (which bundles one) is not installed; run `make install`") from None
    return Path(pytriton.__file__).parent / "tritonserver"


def find_tritonserver() -> Path:
    """The NGC container's binary when present, else the one inside the nvidia-pytriton wheel."""
    ngc = NGC_ROOT / "bin" / "tritonserver"
    if ngc.exists():
        return ngc
    binary = _pytriton_root() / "bin" / "tritonserver"
    if not binary.exists():
        raise ServerStartError(f"the nvidia-pytriton package has no tritonserver at {binary}")
    return binary


def prepare_backends(work_dir: Path) -> Path:
    """A backend directory whose python/ holds libtriton_python.so and a stub for this Python."""
    if (NGC_ROOT / "bin" / "tritonserver").exists():
        return NGC_ROOT / "backends"
    root = _pytriton_root()
    version = f"{sys.version_info.major}.{sys.version_info.minor}"
    stub = root / "python_backend_stubs" / version / "triton_python_backend_stub"
    if not stub.exists():
        raise ServerStartError(f"nvidia-pytriton has no Python backend stub for Python {version} ({stub})")
    backends = Path(work_dir) / "backends"
    dest = backends / "python"
    dest.mkdir(parents=True, exist_ok=True)
    files = [f for f in (root / "backends" / "python").iterdir() if f.is_file()]
    # The stub's RPATH finds its libraries relative to its own folder: it must sit here.
    for src in [*files, stub]:
        _install(src, dest / src.name)
    return backends


def _install(src: Path, dst: Path) -> None:
    """Copy src to dst unless an identical copy is there, atomically: another server may be
    running from this folder, and rewriting a loaded library in place crashes it."""
    st = src.stat()
    if dst.exists() and dst.stat().st_size == st.st_size and int(dst.stat().st_mtime) == int(st.st_mtime):
        return
    tmp = dst.with_name(f".{dst.name}.{os.getpid()}.tmp")
    shutil.copy2(src, tmp)
    os.replace(tmp, dst)


def server_env(base: dict[str, str] | None = None) -> dict[str, str]:
    env = dict(os.environ if base is None else base)
    libdirs = [sysconfig.get_config_var("LIBDIR")]
    if not (NGC_ROOT / "bin" / "tritonserver").exists():
        libdirs.append(str(_pytriton_root().parent.parent / "nvidia_pytriton.libs"))
    env["LD_LIBRARY_PATH"] = os.pathsep.join(p for p in (*libdirs, env.get("LD_LIBRARY_PATH")) if p)
    bindir = str(Path(sys.executable).parent)
    env["PATH"] = os.pathsep.join(p for p in (bindir, env.get("PATH")) if p)
    # One torch thread pool per model process is plenty on small machines; the engine sets its
    # own thread count. Leave a user's explicit setting alone.
    env.setdefault("OMP_NUM_THREADS", str(min(4, os.cpu_count() or 1)))
    return env


class WorkDirLock:
    """Exclusive use of a work dir while a server runs from it: a second server rendering into the
    same folder would delete the first one's repository under it. Acquired on construction
    (raises ServerStartError when taken); released on exit or by the OS when the process ends."""

    def __init__(self, work_dir: Path):
        work_dir = Path(work_dir)
        work_dir.mkdir(parents=True, exist_ok=True)
        self._file = open(work_dir / ".lock", "w")
        try:
            fcntl.flock(self._file, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            self._file.close()
            raise ServerStartError(f"{work_dir} is in use by another running server; "
                                   "give this one its own work dir") from None

    def __enter__(self) -> "WorkDirLock":
        return self

    def __exit__(self, *exc) -> None:
        fcntl.flock(self._file, fcntl.LOCK_UN)
        self._file.close()


@dataclass(frozen=True)
class Ports:
    http: int
    grpc: int
    metrics: int

    @classmethod
    def free(cls) -> "Ports":
        # Bind all three at once so the OS cannot hand the same port out twice.
        socks = [socket.socket(socket.AF_INET, socket.SOCK_STREAM) for _ in range(3)]
        try:
            for s in socks:
                s.bind(("127.0.0.1", 0))
            return cls(*(s.getsockname()[1] for s in socks))
        finally:
            for s in socks:
                s.close()


# What tritonserver logs when a port it was given is taken.
PORT_TAKEN = ("already in use", "Failed to bind", "failed to start")
PORT_RETRIES = 8


@dataclass
class TritonServer:
    """One tritonserver process serving `repository`; use as a context manager or start()/stop()."""

    repository: Path
    work_dir: Path
    ports: Ports | None = None        # None: free ports, chosen again if one is taken (needs log_file)
    log_file: Path | None = None      # None: inherit stdout/stderr (the CLI's foreground mode)
    log_verbose: int = 0
    exit_timeout_s: int = 30              # how long shutdown waits for in-flight requests
    extra_args: list[str] = field(default_factory=list)
    admin_key: str = field(default_factory=new_key, repr=False)
    process: subprocess.Popen | None = None

    def __post_init__(self) -> None:
        self._auto_ports = self.ports is None
        if self._auto_ports:
            self.ports = Ports.free()

    @property
    def admin_headers(self) -> dict[str, str]:
        """gRPC headers that open the administrative endpoints (tritonclient's `headers=`)."""
        return grpc_headers(self.admin_key)

    def command(self) -> list[str]:
        return [str(find_tritonserver()),
                f"--model-repository={self.repository}",
                f"--backend-directory={prepare_backends(self.work_dir)}",
                f"--http-port={self.ports.http}", f"--grpc-port={self.ports.grpc}",
                f"--metrics-port={self.ports.metrics}",
                "--allow-metrics=true", "--allow-cpu-metrics=true",
                # A model that fails to load must fail the server, not leave it half-serving.
                "--exit-on-error=true", "--strict-readiness=true",
                f"--exit-timeout-secs={self.exit_timeout_s}",
                # Triton's guidance for several servers on one machine (the tests start several):
                # each its own prefix for the Python backend's shared-memory regions. A fresh one
                # per start. (Two full test runs side by side once aborted a server at start with
                # "boost::interprocess::lock_exception"; whether this prevents that is not shown.)
                f"--backend-config=python,shm-region-prefix-name=specserve_{os.getpid()}_{secrets.token_hex(4)}_",
                *restricted_api_args(self.admin_key),
                f"--log-verbose={self.log_verbose}", *self.extra_args]

    def start(self) -> "TritonServer":
        cmd = self.command()
        out = None
        if self.log_file is not None:
            self.log_file.parent.mkdir(parents=True, exist_ok=True)
            out = open(self.log_file, "wb")
        # A new session: stop() signals the server's whole group (it and its model stubs).
        # SIGINT (the graceful shutdown) if the process that started it dies first.
        self.process = subprocess.Popen(die_with_parent(cmd, signal.SIGINT), env=server_env(), stdout=out, stderr=subprocess.STDOUT if out else None,
                                        start_new_session=True)
        if out is not None:
            out.close()
        return self

    @property
    def http_url(self) -> str:
        return f"localhost:{self.ports.http}"

    @property
    def grpc_url(self) -> str:
        return f"localhost:{self.ports.grpc}"

    @property
    def metrics_url(self) -> str:
        return f"http://localhost:{self.ports.metrics}/metrics"

    def is_ready(self) -> bool:
        try:
            with urllib.request.urlopen(f"http://{self.http_url}/v2/health/ready", timeout=2) as r:
                return r.status == 200
        except (urllib.error.URLError, ConnectionError, TimeoutError, OSError):
            return False

    def wait_ready(self, timeout: float = 180.0) -> None:
        """Block until every model is ready; raise ServerStartError if the server dies or times out.
        A server on automatic ports that lost one of them to another process starts again on
        fresh ports."""
        deadline = time.monotonic() + timeout
        retries = 0
        while time.monotonic() < deadline:
            code = self.process.poll() if self.process else None
            if code is not None:
                self._kill_group()
                if self._auto_ports and retries < PORT_RETRIES and self._lost_a_port():
                    retries += 1
                    self.ports = Ports.free()
                    self.start()
                    continue
                raise ServerStartError(f"tritonserver exited with code {code} before it was ready"
                                       + self._log_hint())
            if self.is_ready():
                # A taken metrics port does not stop tritonserver: it serves without metrics.
                if not self._lost_a_port():
                    return
                if not (self._auto_ports and retries < PORT_RETRIES):
                    self.stop()
                    raise ServerStartError("tritonserver could not bind one of its ports" + self._log_hint())
                retries += 1
                self.stop()
                self.ports = Ports.free()
                self.start()
                continue
            time.sleep(0.5)
        raise ServerStartError(f"tritonserver was not ready after {timeout:.0f} s" + self._log_hint())

    def _lost_a_port(self) -> bool:
        if self.log_file is None or not self.log_file.exists():
            return False
        ports = [str(p) for p in (self.ports.http, self.ports.grpc, self.ports.metrics)]
        return any(any(p in line for p in PORT_TAKEN) and any(f":{port}" in line for port in ports)
                   for line in self.log_file.read_text(errors="replace").splitlines())

    def _log_hint(self) -> str:
        if self.log_file is None or not self.log_file.exists():
            return ""
        tail = self.log_file.read_text(errors="replace").splitlines()[-25:]
        return f"; last lines of {self.log_file}:\n" + "\n".join(tail)

    def _kill_group(self) -> None:
        """SIGKILL what is left of the server's process group. A server that aborts (a signal, an
        exception in its backend) leaves its Python-backend stubs running, each holding a model's
        weights and shared memory, until something kills them: here, not the user."""
        try:
            os.killpg(self.process.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass                                               # nothing was left

    def stop(self) -> int | None:
        if self.process is None:
            return None
        if self.process.poll() is not None:
            self._kill_group()
            return self.process.returncode
        # SIGINT is tritonserver's graceful shutdown (it unloads models, which stops our loops).
        os.killpg(self.process.pid, signal.SIGINT)
        try:
            return self.process.wait(self.exit_timeout_s + 15)
        except subprocess.TimeoutExpired:
            os.killpg(self.process.pid, signal.SIGKILL)
            return self.process.wait(10)

    def __enter__(self) -> "TritonServer":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()
