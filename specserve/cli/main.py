"""specserve: lossless speculative decoding served by Triton.

The `specserve` command. Subcommands register themselves in COMMANDS (serve now; bench,
drafters, … as they are built).

    specserve serve --target models/demo/target [--http-port 8000] [--grpc-port 8001]
                    [--metrics-port 8002] [--max-num-seqs 16] [--max-model-len L] [--work-dir W]
"""

from __future__ import annotations

import argparse
import signal
import socket
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Callable

from specserve.cli.checks import (CliError, check_attention_flag, check_checkpoint, check_quantization_flags,
                                  check_tensor_parallel_flag, resolve_drafters)
from specserve.serving.auth import ADMIN_KEY_ENV, ADMIN_KEY_FILE
from specserve.methods import registry

if TYPE_CHECKING:
    from specserve.serving.settings import DeploymentSettings

# Kubernetes' terminationGracePeriodSeconds in deploy/k8s must exceed this (tests check it).
DRAIN_TIMEOUT_S = 30.0


# -- serve ---------------------------------------------------------------------------------------
def _add_serve(sub: argparse._SubParsersAction) -> None:
    from specserve.serving import settings

    p = sub.add_parser("serve", help="render a model repository for a checkpoint and run tritonserver",
                       description="Render a Triton model repository for a Hugging Face checkpoint folder "
                                   "(config.json, *.safetensors, tokenizer.json) and run tritonserver in "
                                   "the foreground. Ctrl-C stops it.")
    # The deployment's settings: one flag per DeploymentSettings field (help, choices, default).
    settings.add_arguments(p)
    # What serve finds or resolves into settings, and the server process's own flags.
    p.add_argument("--drafter", action="append", default=[], metavar="METHOD=DIR",
                   help="serve a trained drafter, e.g. eagle=models/demo/eagle, dflash=models/demo/dflash or "
                        "draft=models/demo/draft (repeatable); without it, drafters in folders named after "
                        "their method beside the target are used")
    p.add_argument("--no-drafters", action="store_true", help="serve no drafter even if one is found")
    p.add_argument("--no-text-gate", action="store_true", help="no text-type gate: dflash runs for every text")
    p.add_argument("--tiers", type=Path, default=None, metavar="FILE",
                   help="service tiers (e.g. config/tiers.yaml): one ensemble llm_<tier> per tier with "
                        "its method, settings, max_tokens limit and scheduling priority; checked before the "
                        "server starts")
    p.add_argument("--http-port", type=int, default=8000)
    p.add_argument("--grpc-port", type=int, default=8001)
    p.add_argument("--metrics-port", type=int, default=8002)
    p.add_argument("--openai-port", type=int, default=None, metavar="N",
                   help="also serve the OpenAI-compatible API (/v1/chat/completions, …) on this port")
    p.add_argument("--drain-timeout", type=float, default=DRAIN_TIMEOUT_S,
                   help="on SIGTERM / Ctrl-C: seconds in-flight requests may keep streaming to their end "
                        "(no new ones are accepted, the server reports not ready) before the rest are ended "
                        "with an error and the server exits")
    p.add_argument("--admin-key-file", type=Path, default=None,
                   help=f"file holding the key that opens Triton's model-control and config endpoints "
                        f"(default: ${ADMIN_KEY_ENV}, else WORK_DIR/{ADMIN_KEY_FILE}, made at start)")
    p.add_argument("--work-dir", type=Path, default=Path("work_dirs/serve"),
                   help="where the rendered repository, backends and logs go")
    p.set_defaults(run=_serve)


def resolve_text_classifier(target: Path, flag: Path | None, disabled: bool, methods: list[str]) -> str | None:
    """The classifier folder of the text-type gate: --text-classifier, else one beside the target
    when the gated method is served; None with --no-text-gate."""
    from specserve.serving.text_classifier import ClassifierConfig, GateError

    GATED_METHOD = registry.gated_method()

    if disabled:
        if flag is not None:
            raise CliError("--text-classifier and --no-text-gate contradict each other")
        return None
    if flag is None:
        beside = target.resolve().parent / "text_classifier"
        if GATED_METHOD not in methods or not (beside / "config.json").is_file():
            return None
        flag = beside
    elif GATED_METHOD not in methods:
        raise CliError(f"--text-classifier gates {GATED_METHOD} requests, and this server does not serve "
                       f"{GATED_METHOD}; served: {', '.join(methods)}")
    try:
        ClassifierConfig.load(flag)
    except GateError as e:
        raise CliError(f"--text-classifier: {e}") from None
    return str(flag)


def _check_port(port: int, flag: str) -> None:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        try:
            s.bind(("0.0.0.0", port))
        except OSError:
            raise CliError(f"port {port} is already in use; choose another with {flag}") from None


def _load_tiers(path: Path | None, methods: list[str], max_draft_len: int, max_len: int) -> tuple:
    """The validated tiers of --tiers FILE (none without it); a bad file is the user's error."""
    from specserve.serving.tiers import ServerLimits, TierError, load_tiers

    if path is None:
        return ()
    try:
        return load_tiers(path, ServerLimits(tuple(methods), max_draft_len, max_len, drafted=registry.borrowed()))
    except TierError as e:
        raise CliError(f"--tiers {path}: {e}") from None


def _quantized(settings: "DeploymentSettings") -> str:
    """The startup line's word on the target's weights ("" when they are not quantized)."""
    from specserve.model.quantize import kept_quantization, served_quantization

    kept = kept_quantization(settings.checkpoint)   # serve_settings refused --quantize on a kept folder
    q = served_quantization(settings.quantization(), kept, settings.checkpoint)
    if q.label() == "none":
        return ""
    return f" activations, {q.label()} weights" + (" (kept from the GGUF file)" if kept else "")


def _interrupt(signum, frame) -> None:
    raise KeyboardInterrupt


def serve_settings(args: argparse.Namespace) -> tuple["DeploymentSettings", list[str]]:
    """serve's flags → the DeploymentSettings it serves, every check a user can fail made here,
    before any server starts. Returns (settings, the methods it serves)."""
    from specserve.model.devices import resolve_device
    from specserve.model.quantize import Quantization
    from specserve.serving.build import served_methods
    from specserve.serving.settings import from_args
    from specserve.serving.text_classifier import GateError, parse_text_types

    target = args.checkpoint
    max_len = check_checkpoint(target, args.max_model_len)
    drafters = resolve_drafters(target, args.drafter, args.no_drafters)
    methods = served_methods(drafters)
    try:
        device = resolve_device(args.device)
    except ValueError as e:
        raise CliError(f"--device: {e}") from None
    check_quantization_flags(target, args.quantize, args.quantize_group_size, device.type, args.dtype,
                             args.quantize_head)
    check_attention_flag(args.attention, device.type, args.tensor_parallel)
    check_tensor_parallel_flag(target, args.tensor_parallel, device,
                               Quantization(args.quantize, args.quantize_group_size, args.quantize_head).label())
    found = dict(max_model_len=max_len, drafters=drafters)
    default = from_args(args, **found).method_by_default()
    if default not in methods:
        raise CliError(f"--default-method {default!r} is not one of {', '.join(methods)}")
    found["tiers"] = _load_tiers(args.tiers, methods, args.max_draft_len, max_len)
    types = args.dflash_text_types
    try:   # the flag is a comma list; its default is the settings' tuple
        found["dflash_text_types"] = parse_text_types(types) if isinstance(types, str) else types
    except GateError as e:
        raise CliError(str(e)) from None
    found["text_classifier"] = resolve_text_classifier(target, args.text_classifier, args.no_text_gate, methods)
    settings = from_args(args, default_method=default, **found)
    if settings.drafter_backend != "python" and settings.placement != "remote":
        raise CliError(f"--drafter-backend {settings.drafter_backend} applies to remote drafter models; add "
                       f"--placement remote (fused drafters run inside the engine)")
    if settings.drafter_backend != "python" and not drafters:
        raise CliError(f"--drafter-backend {settings.drafter_backend}: no drafter is served (--drafter METHOD=DIR)")
    if settings.block_size is not None:
        from specserve.serving.tiers import BLOCK_SIZE_RANGE

        if "dflash" not in methods:
            raise CliError("--dflash-block-size: no DFlash drafter is served (--drafter dflash=DIR)")
        lo, hi = BLOCK_SIZE_RANGE
        if not lo <= settings.block_size <= hi:
            raise CliError(f"--dflash-block-size must be in [{lo}, {hi}], got {settings.block_size}")
    if settings.max_num_seqs < 1:
        raise CliError("--max-num-seqs must be at least 1")
    if settings.max_queue_len < 0:
        raise CliError("--max-queue-len must be >= 0")
    return settings, methods


def _serve(args: argparse.Namespace) -> int:
    from specserve.triton.launch import ServerStartError, WorkDirLock

    settings, methods = serve_settings(args)
    if args.drain_timeout < 0:
        raise CliError("--drain-timeout must be >= 0")
    for port, flag in ((args.http_port, "--http-port"), (args.grpc_port, "--grpc-port"),
                       (args.metrics_port, "--metrics-port")):
        _check_port(port, flag)
    work = args.work_dir.resolve()
    try:
        lock = WorkDirLock(work)
    except ServerStartError as e:
        raise CliError(str(e)) from None
    with lock:
        return _run_server(args, settings, work, methods)


def _run_server(args: argparse.Namespace, settings: "DeploymentSettings", work: Path, methods: list[str]) -> int:
    from specserve.triton import drafter_backends
    from specserve.serving.auth import resolve_admin_key
    from specserve.triton.launch import Ports, ServerStartError, TritonServer, prepare_backends
    from specserve.triton.render import render_repository

    # The drafter backend must be one this tritonserver has: checked before the (slow) ONNX
    # export, and every rendered config again after it.
    try:
        backend_dir = prepare_backends(work)
        drafter_backends.check_available(settings.drafter_backend, backend_dir)
        repo = render_repository(settings, work / "model_repository")
        drafter_backends.check_repository(repo, backend_dir)
    except (ServerStartError, drafter_backends.BackendError, FileNotFoundError) as e:
        # FileNotFoundError: an installation without its Triton adapters (render.copy_adapter).
        raise CliError(str(e)) from None
    if settings.drafter_backend != "python":
        for name, why in drafter_backends.STATEFUL.items():
            print(f"specserve: {name} stays a Python model: {why}", flush=True)
    admin_key = resolve_admin_key(args.admin_key_file, work, create=True)
    # Explicit model control, everything loaded at start: remote drafters are hot-loadable, and
    # shutdown unloads `llm` to turn the server not-ready while it drains. Model control is
    # admin-only (auth.py), so no client can unload anything.
    server = TritonServer(repo, work, Ports(args.http_port, args.grpc_port, args.metrics_port),
                          extra_args=list(SERVE_TRITON_ARGS), admin_key=admin_key)
    # Ctrl-C and SIGTERM (docker stop, Kubernetes) both stop the server gracefully; the server
    # runs in its own process group, so the signal reaches it only through server.stop().
    signal.signal(signal.SIGINT, signal.default_int_handler)
    signal.signal(signal.SIGTERM, _interrupt)
    print(f"specserve: serving {settings.checkpoint} (max_model_len={settings.max_model_len}, "
          f"max_num_seqs={settings.max_num_seqs}, methods: {', '.join(methods)}; default {settings.default_method}; "
          f"{settings.dtype}{_quantized(settings)} on {settings.device}) from {repo}", flush=True)
    from specserve.serving.build import where_drafters_run

    for line in where_drafters_run(settings):
        print(f"specserve: {line}", flush=True)
    # One try around everything after start: a signal can arrive at any point (even between
    # "ready" and the wait), and every exit path must take tritonserver down with us.
    try:
        server.start()
        server.wait_ready(timeout=600)
        print(f"specserve: ready\n"
              f"  gRPC     {server.grpc_url}   (model 'llm', streaming)\n"
              f"  HTTP     http://{server.http_url}/v2/models/llm/generate  |  /generate_stream\n"
              + "".join(f"  tier     {t.name}: model '{_tier_model(t.name)}' ({t.method or 'server default'}, "
                        f"priority {t.priority})\n" for t in settings.tiers) +
              f"  metrics  {server.metrics_url}\n"
              f"  Ctrl-C to stop", flush=True)
        openai = _start_openai(args.openai_port, server, settings)
        try:
            code = supervise(server)
        finally:
            if openai is not None:
                openai.stop()
    except ServerStartError as e:
        server.stop()
        raise CliError(f"tritonserver did not start: {e}") from None
    except KeyboardInterrupt:
        from specserve.triton.control import ControlError

        drained = True
        try:
            if server.process is not None and server.process.poll() is None and server.is_ready():
                drain(server, settings.internal_key, args.drain_timeout)
        except KeyboardInterrupt:
            print("specserve: second signal; stopping now", flush=True)
        except ControlError as e:
            # Not drained: in-flight requests may be cut. tritonserver is stopped all the same.
            print(f"specserve: drain failed ({e}); stopping tritonserver", file=sys.stderr, flush=True)
            drained = False
        finally:
            code = server.stop()
        return (0 if drained else 1) if code in (0, None) else code
    except BaseException:
        server.stop()
        raise
    if code != 0:
        print(f"specserve: tritonserver exited with code {code}", file=sys.stderr)
    return code


def _start_openai(port: int | None, server, settings: "DeploymentSettings"):
    """The OpenAI API beside Triton (specserve/openai/), when --openai-port asks for it."""
    if port is None:
        return None
    from specserve.openai.server import make_server

    try:
        api = make_server(server.grpc_url, port, settings.checkpoint, settings.max_model_len, host="0.0.0.0").start()
    except OSError as e:
        raise CliError(f"--openai-port {port}: {e}") from None
    print(f"  OpenAI   http://localhost:{api.port}/v1/chat/completions  |  /v1/completions  |  /v1/models",
          flush=True)
    return api


def _tier_model(name: str) -> str:
    from specserve.serving.schema import tier_ensemble
    return tier_ensemble(name).name


# tritonserver flags `specserve serve` adds (deploy/k8s and docker-compose must agree; tests check).
SERVE_TRITON_ARGS = ("--model-control-mode=explicit", "--load-model=*")


SUPERVISE_POLL_S = 1.0


def supervise(server, poll_s: float = SUPERVISE_POLL_S) -> int:
    """Wait for tritonserver to exit, keeping `llm` whole meanwhile: when a model it needs is gone
    (an operator with the admin key unloaded target_verifier, say), Triton would go on reporting
    the server ready while every request fails. So `llm` is unloaded (the server turns not ready
    at once) and loaded again, which loads what it needs; the server is ready again when it is.
    Returns tritonserver's exit code."""
    import time
    import urllib.error
    import urllib.request

    import tritonclient.grpc as grpcclient
    from tritonclient.utils import InferenceServerException

    while server.process.poll() is None:
        time.sleep(poll_s)
        try:
            with urllib.request.urlopen(f"http://{server.http_url}/v2/models/llm/ready", timeout=5):
                continue   # 200: llm and all its steps are ready
        except urllib.error.HTTPError:
            pass           # 400: llm has no ready version
        except OSError:
            continue       # the server is going away; poll() will tell
        print("specserve: 'llm' is not ready (a model it needs was unloaded); the server reports not ready "
              "while it is loaded again", flush=True)
        client = grpcclient.InferenceServerClient(server.grpc_url)
        try:
            client.unload_model("llm", headers=server.admin_headers)
            client.load_model("llm", headers=server.admin_headers)
            print("specserve: 'llm' is ready again", flush=True)
        except InferenceServerException as e:
            print(f"specserve: reloading 'llm' failed ({e.message()}); trying again", flush=True)
            time.sleep(10 * poll_s)
    return server.process.returncode


UNLOAD_WAIT_S = 30.0   # at least this long for tritonserver to answer the drain's unload of `llm`


def drain(server, internal_key: str, timeout: float, poll_s: float = 0.25) -> int:
    """Graceful shutdown, before tritonserver itself is stopped: the engine refuses new requests,
    `llm` is unloaded so the server reports not ready (in-flight streams keep their models until
    they end), in-flight streams run to their end for up to `timeout` seconds, and whatever is
    left is ended with an error saying so. Returns how many were ended that way.

    Why not leave it to tritonserver: on SIGINT/SIGTERM it unloads every model at once, including
    preprocess/postprocess, which have nothing in flight, so every stream stalls until the exit
    timeout and is cut by the transport."""
    import threading
    import time

    from specserve.triton.control import ControlError, send_control

    print(f"specserve: draining (up to {timeout:g} s for in-flight requests)", flush=True)
    deadline = time.monotonic() + timeout

    def control(command: str) -> dict:
        # A control call that times out on a loaded machine is tried again until the drain's own
        # deadline: the caller stops tritonserver whatever happens here.
        while True:
            try:
                return send_control(server.grpc_url, internal_key, command)
            except ControlError:
                if time.monotonic() >= deadline:
                    raise

    control("drain")
    unloader = threading.Thread(target=_unload_quietly, args=(server, "llm"), daemon=True)
    unloader.start()
    live = control("status")["live"]
    while live and time.monotonic() < deadline:
        time.sleep(poll_s)
        live = control("status")["live"]
    if live:
        print(f"specserve: drain time over; ending {live} request(s) with an error", flush=True)
        send_control(server.grpc_url, internal_key, "abort")
        end = time.monotonic() + 5
        while time.monotonic() < end:
            try:
                if not send_control(server.grpc_url, internal_key, "status")["live"]:
                    break
            except ControlError:
                break
            time.sleep(poll_s)
    # tritonserver is stopped only once it has answered the unload of `llm`: an unload still
    # on its way when shutdown starts left the ensemble live until the exit timeout (on a loaded
    # machine), and tritonserver then exits 1. With nothing in flight the answer comes at once.
    unloader.join(max(deadline - time.monotonic(), UNLOAD_WAIT_S))
    if unloader.is_alive():
        print("specserve: tritonserver has not unloaded llm; stopping it all the same", flush=True)
    print("specserve: drained; stopping tritonserver", flush=True)
    return live


def _unload_quietly(server, name: str) -> None:
    import tritonclient.grpc as grpcclient
    from tritonclient.utils import InferenceServerException

    try:
        grpcclient.InferenceServerClient(server.grpc_url).unload_model(name, headers=server.admin_headers)
    except InferenceServerException as e:
        print(f"specserve: unloading {name} failed ({e.message()}); readiness may not turn false", flush=True)


COMMANDS: list[Callable[[argparse._SubParsersAction], None]] = [_add_serve]


# -- drafters (hot-loading) -------------------------------------------------------------------------
def _add_drafters(sub: argparse._SubParsersAction) -> None:
    from specserve.triton.drafters import LOADABLE_MODELS, __doc__ as doc

    p = sub.add_parser("drafters", help="list / load / unload remote drafters on a running server",
                       description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("action", choices=("list", "load", "unload", "publish"))
    p.add_argument("name", nargs="?", help=f"drafter model ({', '.join(LOADABLE_MODELS)})")
    p.add_argument("--url", default="localhost:8001", help="the server's gRPC address")
    p.add_argument("--target", type=Path, help="publish: the served target checkpoint")
    p.add_argument("--drafter", type=Path, help="publish: the EAGLE drafter folder to publish")
    p.add_argument("--classifier", type=Path,
                   help="publish: a text-type classifier folder to publish as the next text_classifier version")
    p.add_argument("--repository", type=Path, default=Path("work_dirs/serve/model_repository"),
                   help="publish: the served model repository")
    p.add_argument("--load", action="store_true", help="publish: load the new version right away")
    p.add_argument("--admin-key-file", type=Path, default=Path("work_dirs/serve") / ADMIN_KEY_FILE,
                   help=f"the server's admin key (default: ${ADMIN_KEY_ENV}, else this file, which "
                        "`specserve serve` writes in its work dir)")
    p.set_defaults(run=_drafters)


def _drafters(args: argparse.Namespace) -> int:
    from specserve.triton import drafters
    from specserve.serving.auth import resolve_admin_key

    key = resolve_admin_key(args.admin_key_file)
    if key is None and (args.action != "publish" or args.load):
        raise CliError(f"no admin key: set ${ADMIN_KEY_ENV} or pass --admin-key-file (the server's "
                       f"work dir holds {ADMIN_KEY_FILE})")
    try:
        if args.action == "publish":
            if args.classifier:
                if args.drafter or args.target:
                    raise CliError("drafters publish takes either --classifier or --target and --drafter")
                source, version = args.classifier, drafters.publish_classifier(args.classifier, args.repository)
                published, ensemble = "text_classifier", "text_classifier"
            else:
                if not args.target or not args.drafter:
                    raise CliError("drafters publish needs --target and --drafter")
                source, version = args.drafter, drafters.publish(args.target, args.drafter, args.repository)
                published, ensemble = "eagle_backbone / calibration_head", "eagle_proposal"
            print(f"published {source} as version {version} of {published}")
            if args.load:
                drafters.load(args.url, ensemble, key)
                print(f"loaded {ensemble}")
            return 0
        if args.action == "list":
            for m in drafters.list_models(args.url, key):
                mark = ("drafter" if m.name in drafters.DRAFTER_MODELS else
                        "gate" if m.name in drafters.LOADABLE_MODELS else "")
                print(f"{m.name:20s} {m.version or '-':>3s} {m.state:12s} {mark:8s} {m.reason}")
            return 0
        if not args.name:
            raise CliError(f"drafters {args.action} needs a model name")
        (drafters.load if args.action == "load" else drafters.unload)(args.url, args.name, key)
        print(f"{args.action}ed {args.name}")
        return 0
    except drafters.DrafterError as e:
        raise CliError(str(e)) from None


COMMANDS.append(_add_drafters)


# -- tiers (live changes) ---------------------------------------------------------------------------
def _add_tiers(sub: argparse._SubParsersAction) -> None:
    from specserve.triton.tier_control import __doc__ as doc

    p = sub.add_parser("tiers", help="list service tiers / apply a changed tiers file on a running server",
                       description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("action", choices=("list", "apply"))
    p.add_argument("file", nargs="?", type=Path, help="apply: the tiers file")
    p.add_argument("--url", default="localhost:8001", help="the server's gRPC address")
    p.add_argument("--admin-key-file", type=Path, default=Path("work_dirs/serve") / ADMIN_KEY_FILE,
                   help=f"the server's admin key (default: ${ADMIN_KEY_ENV}, else this file)")
    p.add_argument("--repository", type=Path, default=None,
                   help="apply: the served model repository, when on this machine: the new configs are "
                        "written there too, so a reload from disk keeps them")
    p.set_defaults(run=_tiers)


def _tiers(args: argparse.Namespace) -> int:
    from specserve.triton import tier_control
    from specserve.serving.auth import resolve_admin_key
    from specserve.serving.tiers import TierError

    key = resolve_admin_key(args.admin_key_file)
    if key is None:
        raise CliError(f"no admin key: set ${ADMIN_KEY_ENV} or pass --admin-key-file (the server's "
                       f"work dir holds {ADMIN_KEY_FILE})")
    try:
        if args.action == "list":
            for st in tier_control.list_tiers(args.url, key):
                t = st.tier
                print(f"{t.name:12s} {st.ensemble:16s} method={t.method or '(server default)'} "
                      f"fallback={t.fallback} priority={t.priority} num_draft_tokens={t.max_draft_len} "
                      f"spec_threshold={t.spec_threshold} draft_policy={t.draft_policy} "
                      f"max_tokens<={t.max_tokens}")
            return 0
        if args.file is None:
            raise CliError("tiers apply needs a tiers file")
        for c in tier_control.apply(args.url, args.file, key, args.repository):
            print(f"{c.tier}: {'changed (preprocess reloaded)' if c.changed else 'unchanged'}")
        return 0
    except TierError as e:
        raise CliError(f"{args.file}: {e}") from None
    except tier_control.TierControlError as e:
        raise CliError(str(e)) from None


COMMANDS.append(_add_tiers)


# -- bench (specserve/cli/bench/) ---------------------------------------------------------------------
def _add_bench(sub: argparse._SubParsersAction) -> None:
    from specserve.cli.bench.command import __doc__ as doc, add_arguments, run_cli
    p = sub.add_parser("bench", help="serving benchmark: TTFT / TPOT / P99 / throughput per method, "
                       "same-run ratios to plain decoding and to transformers", description=doc,
                       formatter_class=argparse.RawDescriptionHelpFormatter)
    add_arguments(p)
    p.set_defaults(run=run_cli)


COMMANDS.append(_add_bench)


# -- import-gguf (specserve/model/gguf_import.py) ----------------------------------------------------
def _add_import_gguf(sub: argparse._SubParsersAction) -> None:
    from specserve.model.gguf_import import DTYPES, __doc__ as doc

    p = sub.add_parser("import-gguf", help="a Llama / Qwen2 / Mistral GGUF file → a checkpoint folder to serve",
                       description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("file", type=Path, help="the .gguf file")
    p.add_argument("out", type=Path, help="the checkpoint folder to write (`specserve serve --target OUT`)")
    p.add_argument("--dtype", choices=DTYPES, default="float32", help="dtype of the written weights")
    p.add_argument("--keep-quantized", action="store_true",
                   help="keep the decoder projections as the file stores them (Q4_0 / Q4_1 → int4 group 32, "
                        "served on the int4 kernel); other projection types are refused by name")
    p.set_defaults(run=_import_gguf)


def _import_gguf(args: argparse.Namespace) -> int:
    from specserve.model.gguf_import import GGUFImportError, import_gguf

    try:
        out = import_gguf(args.file, args.out, args.dtype, keep_quantized=args.keep_quantized)
    except GGUFImportError as e:
        raise CliError(str(e)) from None
    if args.keep_quantized:
        from specserve.model.gguf_q4 import KeptReport

        print(f"specserve: {KeptReport.of_folder(out).summary()}")
    print(f"specserve: wrote {out} ({args.dtype}); serve it with `specserve serve --target {out}`", flush=True)
    return 0


COMMANDS.append(_add_import_gguf)


# -- openai (specserve/openai/) ----------------------------------------------------------------------
def _add_openai(sub: argparse._SubParsersAction) -> None:
    from specserve.openai import __doc__ as doc

    p = sub.add_parser("openai", help="serve the OpenAI-compatible API for a running specserve server",
                       description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--url", default="localhost:8001", help="the server's gRPC address (HOST:PORT)")
    p.add_argument("--port", type=int, default=8080, help="the HTTP port to serve on (0: any free one)")
    p.add_argument("--host", default="127.0.0.1", help="the address to bind (0.0.0.0: every interface)")
    p.add_argument("--target", type=Path, required=True,
                   help="the served checkpoint folder (its chat template, tokenizer and folder name = model id)")
    p.add_argument("--max-model-len", type=int, default=None,
                   help="as given to `specserve serve` (default: the same default)")
    p.set_defaults(run=_openai)


def _openai(args: argparse.Namespace) -> int:
    from specserve.openai.server import make_server

    max_len = check_checkpoint(args.target, args.max_model_len)
    try:
        api = make_server(args.url, args.port, args.target, max_len, host=args.host)
    except OSError as e:
        raise CliError(f"--port {args.port}: {e}") from None
    print(f"specserve: OpenAI API for {args.url} on http://{args.host}:{api.port}/v1 (Ctrl-C to stop)", flush=True)
    api.run()
    return 0


COMMANDS.append(_add_openai)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="specserve", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for add in COMMANDS:
        add(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return args.run(args)
    except CliError as e:
        print(f"specserve: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
