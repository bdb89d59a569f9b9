"""`specserve serve` and `make demo`: clear errors before any server starts, and a real run."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import make_served_checkpoint, serve_process
from specserve.cli.main import main
from specserve.triton.launch import Ports


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return make_served_checkpoint(tmp_path_factory.mktemp("cli_ckpt"), "qwen2")


def _serve(*args: str) -> int:
    return main(["serve", *args])


def test_missing_checkpoint_exits_2_with_a_message(tmp_path, capsys):
    assert _serve("--target", str(tmp_path / "nope")) == 2
    assert "does not exist" in capsys.readouterr().err


def test_unsupported_architecture(tmp_path, capsys):
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "gpt2"}))
    assert _serve("--target", str(tmp_path)) == 2
    assert "unsupported architecture" in capsys.readouterr().err


def test_missing_tokenizer(tmp_path, capsys, ckpt):
    for f in ckpt.iterdir():
        if f.name != "tokenizer.json":
            (tmp_path / f.name).write_bytes(f.read_bytes())
    assert _serve("--target", str(tmp_path)) == 2
    assert "no tokenizer.json" in capsys.readouterr().err


def test_model_length_above_the_model_limit(ckpt, capsys):
    assert _serve("--target", str(ckpt), "--max-model-len", "100000") == 2
    assert "--max-model-len 100000 must be in [1, 512]" in capsys.readouterr().err


def test_dflash_block_size_is_checked_before_anything_starts(ckpt, capsys):
    assert _serve("--target", str(ckpt), "--dflash-block-size", "4") == 2
    assert "--dflash-block-size: no DFlash drafter is served (--drafter dflash=DIR)" in capsys.readouterr().err
    demo = Path(__file__).resolve().parents[1] / "models" / "demo" / "target"
    assert _serve("--target", str(demo), "--dflash-block-size", "17") == 2
    assert "--dflash-block-size must be in [2, 16], got 17" in capsys.readouterr().err


def test_port_in_use(ckpt, capsys):
    free = Ports.free()
    with socket.socket() as s:
        s.bind(("0.0.0.0", 0))
        s.listen()
        port = s.getsockname()[1]
        assert _serve("--target", str(ckpt), "--http-port", str(free.http), "--metrics-port", str(free.metrics),
                      "--grpc-port", str(port)) == 2
    assert f"port {port} is already in use" in capsys.readouterr().err


def test_work_dir_in_use(ckpt, tmp_path, capsys):
    from specserve.triton.launch import WorkDirLock
    free = Ports.free()
    with WorkDirLock(tmp_path):  # as a running `specserve serve` holds it
        assert _serve("--target", str(ckpt), "--work-dir", str(tmp_path), "--http-port", str(free.http),
                      "--grpc-port", str(free.grpc), "--metrics-port", str(free.metrics)) == 2
    assert "is in use by another running server" in capsys.readouterr().err


def test_an_installation_without_its_adapters_is_an_error_not_a_traceback(ckpt, tmp_path, capsys, monkeypatch):
    from specserve.triton import render

    monkeypatch.setattr(render, "TEMPLATES", tmp_path / "no_adapters")
    free = Ports.free()
    assert _serve("--target", str(ckpt), "--work-dir", str(tmp_path / "work"), "--http-port", str(free.http),
                  "--grpc-port", str(free.grpc), "--metrics-port", str(free.metrics)) == 2
    assert "the installed specserve has no model template preprocess/1/model.py" in capsys.readouterr().err


@pytest.mark.triton
def test_serve_runs_in_the_foreground_and_stops_on_sigterm(ckpt, tmp_path):
    from specserve.triton.client import StreamClient

    with serve_process([sys.executable, "-m", "specserve.cli.main"], "--target", str(ckpt), "--max-num-seqs", "2",
                       "--work-dir", str(tmp_path / "work"), ready_timeout=120) as served:
        ports = served.ports
        endpoints = served.next_lines(3)
        assert f"localhost:{ports.grpc}" in endpoints and f"localhost:{ports.metrics}/metrics" in endpoints
        out = StreamClient(f"localhost:{ports.grpc}").generate("hello 世界", {"max_tokens": 5})
        assert out.num_output_tokens == 5
        assert served.stop() == 0, served.tail()


@pytest.mark.triton
def test_demo_streams_both_methods_and_stops(ckpt):
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    done = subprocess.run([sys.executable, "-m", "specserve.cli.demo", "--target", str(ckpt), "--max-tokens", "8"],
                          capture_output=True, text=True, timeout=300, env=env)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert "--- none:" in done.stdout and "--- ngram:" in done.stdout
    assert "summary" in done.stdout and "tritonserver stopped." in done.stdout


def test_drain_tries_a_timed_out_control_call_again_until_its_deadline(monkeypatch):
    """A control call that times out (a loaded machine) is sent again; past the drain's deadline
    the error reaches serve, which stops tritonserver all the same and exits 1."""
    import types

    from specserve.cli import main as cli
    from specserve.triton import control

    calls = []

    def answer_second_time(url, key, command, timeout=10.0):
        calls.append(command)
        if len(calls) == 1:
            raise control.ControlError("no answer to 'drain' within 10 s")
        return {"live": 0}

    monkeypatch.setattr(control, "send_control", answer_second_time)
    monkeypatch.setattr(cli, "_unload_quietly", lambda server, name: None)
    server = types.SimpleNamespace(grpc_url="localhost:1")
    assert cli.drain(server, "k", timeout=60) == 0
    assert calls == ["drain", "drain", "status"]

    def never(url, key, command, timeout=10.0):
        raise control.ControlError(f"no answer to {command!r} within 10 s")

    monkeypatch.setattr(control, "send_control", never)
    with pytest.raises(control.ControlError, match="no answer to 'drain'"):
        cli.drain(server, "k", timeout=0)


def test_drain_returns_only_once_tritonserver_answered_the_unload_of_llm(monkeypatch):
    """Stopping tritonserver while its unload of `llm` is still on the way left the ensemble live
    until the exit timeout on a loaded machine (serve then exited 1): drain waits for the answer."""
    import threading
    import types

    from specserve.cli import main as cli
    from specserve.triton import control

    events, asked_status = [], threading.Event()

    def send(url, key, command, timeout=10.0):
        if command == "status":
            asked_status.set()
        return {"live": 0}

    def unload(server, name):
        asked_status.wait()          # answered only after drain found nothing in flight
        events.append(f"unloaded {name}")

    monkeypatch.setattr(control, "send_control", send)
    monkeypatch.setattr(cli, "_unload_quietly", unload)
    assert cli.drain(types.SimpleNamespace(grpc_url="localhost:1"), "k", timeout=60) == 0
    events.append("drain returned")
    assert events == ["unloaded llm", "drain returned"]
