"""`make image-check`: build the CPU image on the locally made base, serve it, talk to it, stop it.

  1. the wheelhouse (wheels/, from this machine's pip: no index is needed inside the build) and
     `docker build --target cpu` on specserve-base:bookworm (scripts/make_base_image.sh);
  2. scripts/image_check.py inside the image;
  3. the container with docker-compose.yml's CPU serve command, ports published on 127.0.0.1:
     readiness, a greedy completion streamed over the published gRPC port with the project's
     client and the same one over HTTP generate_stream (the same text), the metrics endpoint;
  4. `docker stop` while two long streams run: both must end complete (finish_reason length,
     every token), the server must log its drain, and the container must exit by itself (not
     killed at the grace period): SIGTERM reached the server through the init process;
  5. `docker compose --profile cpu up` of the services whose images exist here (the others are
     named and skipped), one completion through it, `docker compose ps`, then `down` without the
     admin key file.

Prints a report (and writes it with --out). Exit 0 when every step passed, 3 when no Docker
daemon answers (nothing was tried), 1 otherwise.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[1]
IMAGE = "specserve:cpu"
BASE = "specserve-base:bookworm"
NAME = "specserve-image-check"
PROMPT = "def fibonacci(n):"
GREEDY = {"max_tokens": 24, "temperature": 0.0}
LONG = {"max_tokens": 96, "temperature": 0.0, "spec_method": "none"}
READY_TIMEOUT_S = 900   # a loaded 2-core machine: the remote drafter's ONNX export comes first
# The drain check's budget: the compose command's --drain-timeout (30 s) is sized for a server,
# and on a busy 2-core machine two 96-token streams can outlast it (the server then ends them with
# its drain-ran-out error, as it should). What is checked here is that SIGTERM reaches the server
# and in-flight streams finish, so this container gets a longer drain and grace period.
DRAIN_S, GRACE_S = 150, 180


class Report:
    def __init__(self):
        self.lines: list[str] = []
        self.failed = False

    def say(self, text: str) -> None:
        print(text, flush=True)
        self.lines.append(text)

    def check(self, ok: bool, what: str) -> bool:
        self.say(f"{'ok  ' if ok else 'FAIL'} {what}")
        self.failed |= not ok
        return ok


def sh(*cmd: str, check: bool = True, env: dict | None = None, **kw) -> subprocess.CompletedProcess:
    r = subprocess.run(list(cmd), capture_output=True, text=True, env={**os.environ, **(env or {})}, **kw)
    if check and r.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} exited {r.returncode}:\n{r.stdout[-3000:]}\n{r.stderr[-3000:]}")
    return r


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def compose_command() -> list[str]:
    doc = yaml.safe_load((ROOT / "docker-compose.yml").read_text())
    return doc["services"]["specserve-cpu"]["command"]


def wait_ready(http: str, container: str | None, timeout: float = READY_TIMEOUT_S) -> float:
    start = time.monotonic()
    while time.monotonic() - start < timeout:
        try:
            if urllib.request.urlopen(f"http://{http}/v2/health/ready", timeout=3).status == 200:
                return time.monotonic() - start
        except OSError:
            pass
        if container and sh("docker", "inspect", "-f", "{{.State.Running}}", container, check=False).stdout.strip() != "true":
            raise RuntimeError(f"{container} stopped before it was ready:\n"
                               + sh("docker", "logs", "--tail", "40", container, check=False).stderr)
        time.sleep(2)
    raise RuntimeError(f"not ready after {timeout:.0f} s")


def http_stream(http: str, params: dict) -> tuple[str, str]:
    body = {"text_input": PROMPT, "stream": True, "exclude_input_in_output": True,
            "sampling_parameters": json.dumps(params)}
    req = urllib.request.Request(f"http://{http}/v2/models/llm/generate_stream", data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"})
    events = []
    with urllib.request.urlopen(req, timeout=300) as r:
        for line in r:
            line = line.decode().strip()
            if line.startswith("data:"):
                events.append(json.loads(line[len("data:"):]))
    return "".join(e["text_output"] for e in events), events[-1]["finish_reason"]


def build(report: Report) -> None:
    if sh("docker", "image", "inspect", BASE, check=False).returncode != 0:
        raise RuntimeError(f"no base image {BASE}: make it once with `scripts/make_base_image.sh` (root, debootstrap)")
    # The wheelhouse: what pip on this machine has (its caches and indexes), for Linux x86_64
    # CPython 3.11 as in the image; the build then needs no index (air-gapped, or behind a TLS
    # proxy whose CA the image does not hold).
    wheels = ROOT / "wheels"
    sh(sys.executable, "-m", "pip", "download", "-q", "-d", str(wheels), "--only-binary=:all:",
       str(ROOT), "setuptools>=68", "wheel")
    for w in wheels.glob("specserve-*.whl"):
        w.unlink()   # the image installs the source tree itself
    report.say(f"wheelhouse: {len(list(wheels.glob('*.whl')))} wheels")
    start = time.monotonic()
    r = sh("nice", "-n", "10", "docker", "build", "--target", "cpu", "-t", IMAGE, str(ROOT),
           env={"DOCKER_BUILDKIT": "0"}, check=False)
    report.check(r.returncode == 0, f"docker build --target cpu -t {IMAGE} (on {BASE}): {time.monotonic() - start:.0f} s")
    if r.returncode != 0:
        raise RuntimeError(r.stdout[-3000:] + r.stderr[-3000:])
    size = sh("docker", "image", "inspect", "-f", "{{.Size}}", IMAGE).stdout.strip()
    report.say(f"image {IMAGE}: {int(size) / 1e9:.2f} GB")


def in_image_check(report: Report) -> None:
    r = sh("docker", "run", "--rm", "--entrypoint", "python3", IMAGE, "scripts/image_check.py", "--image", "cpu",
           check=False)
    for line in r.stdout.strip().splitlines():
        report.say(f"     {line}")
    report.check(r.returncode == 0, "scripts/image_check.py --image cpu inside the image")


def serve_and_stop(report: Report) -> None:
    from specserve.triton.client import StreamClient

    ports = {"http": free_port(), "grpc": free_port(), "metrics": free_port()}
    http, grpc = f"127.0.0.1:{ports['http']}", f"127.0.0.1:{ports['grpc']}"
    sh("docker", "rm", "-f", NAME, check=False)
    command = compose_command()
    # As compose runs it: an init process as PID 1 (init: true), the shared memory, the key.
    command = [*command, f"--drain-timeout={DRAIN_S}"]   # the last one wins
    sh("docker", "run", "-d", "--init", "--name", NAME, "--shm-size", "2g",
       "-e", "SPECSERVE_ADMIN_KEY=image-check-key",
       "-p", f"{http}:8000", "-p", f"{grpc}:8001", "-p", f"127.0.0.1:{ports['metrics']}:8002", IMAGE, *command)
    report.say(f"docker run --init {IMAGE} {' '.join(command)}  (ports on 127.0.0.1: {ports})")
    try:
        took = wait_ready(http, NAME)
        report.check(True, f"ready (GET /v2/health/ready on the published HTTP port) after {took:.0f} s")
        client = StreamClient(grpc)
        out = client.generate(PROMPT, GREEDY, timeout=300)
        client.close()
        report.check(bool(out.text) and len(out.chunks) > 1 and out.finish_reason == "length",
                     f"gRPC stream (published port, specserve.triton.client): {len(out.chunks)} chunks, "
                     f"{out.num_output_tokens} tokens, finish {out.finish_reason}, method "
                     f"{out.spec_stats.get('method')}: {out.text!r}")
        text, finish = http_stream(http, GREEDY)
        report.check(text == out.text and finish == out.finish_reason,
                     f"HTTP generate_stream (published port): the same greedy text, finish {finish}")
        metrics = urllib.request.urlopen(f"http://127.0.0.1:{ports['metrics']}/metrics", timeout=10).read().decode()
        families = sorted({line.split("{")[0].split(" ")[0] for line in metrics.splitlines()
                           if line.startswith("specserve_")})
        success = [line for line in metrics.splitlines()
                   if line.startswith("nv_inference_request_success") and 'model="llm"' in line]
        report.check(bool(families) and bool(success),
                     f"metrics (published port): {len(families)} specserve_* series, e.g. {families[:4]}; {success[:1]}")
        drain(report, grpc)
    finally:
        logs = sh("docker", "logs", "--tail", "15", NAME, check=False)
        for line in (logs.stdout + logs.stderr).strip().splitlines()[-15:]:
            report.say(f"     | {line}")
        sh("docker", "rm", "-f", NAME, check=False)


def drain(report: Report, grpc: str) -> None:
    """docker stop while streams run: they finish, the server drains and exits on its own."""
    from specserve.triton.client import StreamClient

    results: dict[int, object] = {}
    started = [threading.Event() for _ in range(2)]

    def stream(i: int) -> None:
        client = StreamClient(grpc)
        try:
            results[i] = client.generate(PROMPT, LONG, timeout=300, on_chunk=lambda _: started[i].set())
        except Exception as e:  # noqa: BLE001 — reported below
            results[i] = e
        finally:
            started[i].set()
            client.close()

    threads = [threading.Thread(target=stream, args=(i,)) for i in range(2)]
    for t in threads:
        t.start()
    for e in started:
        e.wait(300)
    start = time.monotonic()
    stop = sh("docker", "stop", "-t", str(GRACE_S), NAME, check=False)
    stopped_s = time.monotonic() - start
    for t in threads:
        t.join(300)
    state = json.loads(sh("docker", "inspect", "-f", "{{json .State}}", NAME).stdout)
    logs = sh("docker", "logs", NAME, check=False)
    log_text = logs.stdout + logs.stderr
    for i in range(2):
        r = results.get(i)
        ok = not isinstance(r, Exception) and r is not None and r.finish_reason == "length" \
            and r.num_output_tokens == LONG["max_tokens"]
        report.check(ok, f"in-flight stream {i} across docker stop: "
                         + (f"{r.num_output_tokens} tokens, finish {r.finish_reason}" if ok or not isinstance(r, Exception)
                            else f"error {r}"))
    report.check("specserve: draining" in log_text, "the server logged its drain (SIGTERM reached it)")
    report.check(stop.returncode == 0 and state["ExitCode"] != 137 and not state["OOMKilled"] and stopped_s < GRACE_S,
                 f"docker stop -t {GRACE_S}: the container exited by itself after {stopped_s:.1f} s "
                 f"with code {state['ExitCode']} (137 would be the kill at the grace period)")


def compose(report: Report) -> None:
    binary = Path(__import__("compose").__file__).parent / "docker-compose"
    base = ["-f", str(ROOT / "docker-compose.yml"), "--project-directory", str(ROOT), "-p", "specserve-image-check",
            "--profile", "cpu"]
    services = yaml.safe_load((ROOT / "docker-compose.yml").read_text())["services"]
    runnable, skipped = [], []
    for name, svc in services.items():
        if "cpu" not in svc.get("profiles", []):
            continue
        have = sh("docker", "image", "inspect", svc["image"], check=False).returncode == 0
        (runnable if have else skipped).append(name if have else f"{name} ({svc['image']}: no such image here, "
                                                                  "no registry to pull it from)")
    report.say(f"compose: starting {runnable}; skipped: {skipped}")
    busy = [p for p in (8000, 8001, 8002) if socket.socket().connect_ex(("127.0.0.1", p)) == 0]
    if busy:
        report.check(False, f"compose: host ports {busy} are taken on 127.0.0.1; not started")
        return
    with tempfile.TemporaryDirectory() as tmp:
        key = Path(tmp) / "specserve-admin.env"
        key.write_text("SPECSERVE_ADMIN_KEY=image-check-key\n")
        env = {"SPECSERVE_ADMIN_ENV_FILE": str(key)}
        files = []
        if sh("docker", "run", "--rm", "--ulimit", "memlock=-1", BASE, "true", check=False).returncode != 0:
            # A daemon that may not raise RLIMIT_MEMLOCK (a container without CAP_SYS_RESOURCE,
            # as here) refuses the service's `memlock: -1`: run it without its ulimits, and say so.
            override = Path(tmp) / "no-ulimits.yml"
            override.write_text("services:\n" + "".join(f"  {n}:\n    ulimits: !reset {{}}\n" for n in runnable))
            files = ["-f", str(override)]
            report.say("compose: this daemon may not set memlock=-1 (docker run --ulimit memlock=-1 fails): "
                       "the services run with an override that drops their ulimits")
        base = [base[0], base[1], *files, *base[2:]]
        r = sh(str(binary), *base, "up", "-d", "--no-build", "--no-deps", *runnable, env=env, check=False)
        report.check(r.returncode == 0, f"docker compose --profile cpu up -d {' '.join(runnable)}" + ("" if r.returncode == 0 else f": {r.stderr[-800:]}"))
        try:
            if r.returncode == 0:
                took = wait_ready("127.0.0.1:8000", None)
                from specserve.triton.client import StreamClient

                client = StreamClient("127.0.0.1:8001")
                out = client.generate(PROMPT, GREEDY, timeout=300)
                client.close()
                report.check(bool(out.text), f"compose: ready after {took:.0f} s, gRPC completion {out.text!r}")
                ps = sh(str(binary), *base, "ps", "--format", "{{.Service}} {{.Status}}", check=False)
                report.say(f"     docker compose ps: {ps.stdout.strip()}")
        finally:
            absent = {"SPECSERVE_ADMIN_ENV_FILE": str(Path(tmp) / "absent.env")}
            ps = sh(str(binary), *base, "ps", env=absent, check=False)
            down = sh(str(binary), *base, "down", env=absent, check=False)
            report.check(ps.returncode == 0 and down.returncode == 0,
                         "docker compose ps and down without the admin key file")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", type=Path, default=None, help="also write the report here")
    p.add_argument("--skip-build", action="store_true", help="use the specserve:cpu image already built")
    args = p.parse_args(argv)
    report = Report()
    if shutil.which("docker") is None or sh("docker", "info", check=False).returncode != 0:
        print("image-check: no Docker daemon answers (start dockerd); nothing was tried", file=sys.stderr)
        return 3
    server = sh("docker", "version", "-f", "{{.Server.Version}}").stdout.strip()
    report.say(f"# make image-check, {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}, Docker {server}")
    try:
        if not args.skip_build:
            build(report)
        in_image_check(report)
        serve_and_stop(report)
        compose(report)
    except Exception as e:  # noqa: BLE001 — the report says where it stopped
        report.check(False, f"stopped: {type(e).__name__}: {e}")
    report.say("image-check: " + ("FAILED" if report.failed else "all steps passed"))
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text("\n".join(report.lines) + "\n")
    return 1 if report.failed else 0


if __name__ == "__main__":
    sys.exit(main())
