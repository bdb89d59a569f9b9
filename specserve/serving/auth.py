"""Who may do what to a running server: the admin key and the internal key.

Request ids are not capabilities. Any client can call any model Triton serves, internal ones
included, so the capabilities that matter are keys the client never sees:

- The ADMIN key gates Triton's administrative endpoints (model control, model configs, the
  repository index, tracing, logging): `tritonserver` is started with
  `--grpc-restricted-protocol` / `--http-restricted-api` naming it, and `specserve drafters`
  (and the tests) send it as a header. The operator sets it (`SPECSERVE_ADMIN_KEY`, or a key
  file); `specserve serve` otherwise makes one and writes it to `<work dir>/admin_key` (0600).
  Model configs are restricted because they hold the internal key.
- The INTERNAL key is written into the rendered configs of preprocess, target_verifier and
  postprocess. preprocess signs what it hands the engine (the token ids and the request config,
  HMAC-SHA256), so target_verifier runs only requests that preprocess validated: a client that
  calls target_verifier directly gets no more than the `llm` ensemble allows. Cancelling a
  request (postprocess, by BLS) and the shutdown controls (`specserve serve`) carry the internal
  key itself, so no client can cancel or drain anything by guessing an id.
"""

from __future__ import annotations

import hashlib
import hmac
import os
import secrets
from pathlib import Path
from typing import Sequence

ADMIN_HEADER = "specserve-admin-key"
# tritonserver prefixes the header it checks for restricted gRPC protocols.
GRPC_ADMIN_HEADER = f"triton-grpc-protocol-{ADMIN_HEADER}"
ADMIN_KEY_ENV = "SPECSERVE_ADMIN_KEY"
ADMIN_KEY_FILE = "admin_key"
# Triton's restricted API groups closed to ordinary clients. inference, health, metadata and
# statistics stay open (benchmarks read statistics).
RESTRICTED_APIS = ("model-repository", "model-config", "trace", "logging")


class AuthError(ValueError):
    """A request to an internal model that lacks the right key or signature."""


def new_key() -> str:
    return secrets.token_hex(16)


def restricted_api_args(admin_key: str) -> list[str]:
    apis = ",".join(RESTRICTED_APIS)
    return [f"--grpc-restricted-protocol={apis}:{ADMIN_HEADER}={admin_key}",
            f"--http-restricted-api={apis}:{ADMIN_HEADER}={admin_key}"]


def grpc_headers(admin_key: str | None) -> dict[str, str] | None:
    return None if admin_key is None else {GRPC_ADMIN_HEADER: admin_key}


def resolve_admin_key(key_file: Path | None, work_dir: Path | None = None, *, create: bool = False) -> str | None:
    """The admin key: $SPECSERVE_ADMIN_KEY, else the key file given, else <work_dir>/admin_key
    (made, 0600, when `create`)."""
    env = os.environ.get(ADMIN_KEY_ENV)
    if env:
        return env.strip()
    path = key_file if key_file is not None else (None if work_dir is None else Path(work_dir) / ADMIN_KEY_FILE)
    if path is None:
        return None
    path = Path(path)
    if path.is_file():
        return path.read_text().strip()
    if not create:
        return None
    key = new_key()
    path.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(key + "\n")
    return key


def sign(key: str, input_ids: Sequence[int], config_json: str) -> str:
    """The signature preprocess attaches to (input_ids, request config)."""
    msg = ",".join(str(int(t)) for t in input_ids).encode() + b"|" + config_json.encode()
    return hmac.new(key.encode(), msg, hashlib.sha256).hexdigest()


def check_signature(key: str, input_ids: Sequence[int], config_json: str, signature: str) -> None:
    if not signature or not hmac.compare_digest(sign(key, input_ids, config_json), signature):
        raise AuthError("target_verifier is internal: call the 'llm' ensemble (this request was not "
                        "prepared by preprocess)")


def check_key(key: str, given: str | bytes | None, what: str) -> None:
    if isinstance(given, bytes):
        given = given.decode("utf-8", "replace")
    if not given or not hmac.compare_digest(key, given):
        raise AuthError(f"{what} is reserved for the server itself")
