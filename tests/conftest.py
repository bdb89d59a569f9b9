"""Shared fixtures: tiny random checkpoints of each family, written with save_pretrained."""

from __future__ import annotations

import contextlib
import re
import signal
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

from specserve.triton.launch import PORT_RETRIES, PORT_TAKEN, Ports

# Tests use tiny tensors, where torch's intra-op thread pool only costs: with another process
# busy on the second core, a [4, 5] softmax took 4 ms with 2 threads and 1.4 us with 1.
torch.set_num_threads(1)

FAMILIES = ("llama", "qwen2", "mistral")


def make_tiny_checkpoint(path, family: str, *, vocab_size: int = 512, seed: int = 0,
                         tie: bool = False, rope_scaling: dict | None = None, **overrides) -> str:
    import transformers

    torch.manual_seed(seed)
    common = dict(vocab_size=vocab_size, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                  tie_word_embeddings=tie, bos_token_id=1, eos_token_id=2)
    common.update(overrides)
    if family == "llama":
        cfg = transformers.LlamaConfig(rope_scaling=rope_scaling, **common)
        model = transformers.LlamaForCausalLM(cfg)
    elif family == "qwen2":
        cfg = transformers.Qwen2Config(rope_scaling=rope_scaling, **common)
        model = transformers.Qwen2ForCausalLM(cfg)
    elif family == "mistral":
        cfg = transformers.MistralConfig(sliding_window=common.pop("sliding_window", None),
                                         rope_scaling=rope_scaling, **common)
        model = transformers.MistralForCausalLM(cfg)
    else:
        raise ValueError(family)
    # Random init is nearly uniform; larger weights give peaked, LM-like next-token distributions
    # so greedy decoding is not decided by ties.
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() == 2:
                p.normal_(0, 0.15)
            elif name.endswith("bias"):
                p.normal_(0, 0.1)
    model.save_pretrained(str(path))
    return str(path)


def make_served_checkpoint(path, family: str = "llama", **kw) -> Path:
    """A tiny random checkpoint with the tiny trained tokenizer beside it (what a server needs),
    its vocabulary sized to the tokenizer's; `kw` as make_tiny_checkpoint's."""
    from tokenizers import Tokenizer

    from specserve.model.tiny import train_tiny_tokenizer

    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    train_tiny_tokenizer(path)
    make_tiny_checkpoint(path, family, vocab_size=Tokenizer.from_file(str(path / "tokenizer.json")).get_vocab_size(),
                         **kw)
    return path


@contextlib.contextmanager
def running_server(repo, root, extra_args=()):
    """tritonserver on a rendered repository (ports picked by launch.py), ready; stopped on exit."""
    from specserve.triton.launch import TritonServer

    srv = TritonServer(repo, root, None, log_file=Path(root) / "tritonserver.log", exit_timeout_s=5,
                       extra_args=list(extra_args))
    srv.start()
    try:
        srv.wait_ready(180)
        yield srv
    finally:
        srv.stop()


READY = "specserve: ready"


@dataclass
class ServeProcess:
    """A running `specserve serve`, its output read up to and including the ready banner."""

    proc: subprocess.Popen
    ports: Ports
    output: list[str]

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
        pytest.fail(f"no {marker!r} in the output of specserve serve:\n" + "".join(self.output[-30:]))

    def stop(self, timeout: float = 60) -> int:
        """SIGTERM (docker stop, Kubernetes): serve drains, stops tritonserver and exits; the rest
        of its output is read meanwhile (see tail())."""
        self.proc.send_signal(signal.SIGTERM)
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
def serve_process(command: list[str], *args: str, cwd=None, env=None, ready_timeout: float = 300):
    """`command serve ARGS` (command: `[sys.executable, "-m", "specserve.cli.main"]`, or an
    installed `specserve` script) on free HTTP / gRPC / metrics ports, yielded as a ServeProcess
    once it prints its ready banner. A probed free port can be taken before the server binds it:
    a start that fails, or comes up, having lost one, is stopped and made again on fresh ports
    (launch.PORT_RETRIES times), so no test depends on port luck. Killed on exit if still running."""
    for _ in range(PORT_RETRIES + 1):
        ports = Ports.free()
        proc = subprocess.Popen([*command, "serve", *args, "--http-port", str(ports.http),
                                 "--grpc-port", str(ports.grpc), "--metrics-port", str(ports.metrics)],
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
            assert ready, "specserve serve did not get ready:\n" + "".join(lines[-30:])
            yield ServeProcess(proc, ports, lines)
            return
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    pytest.fail(f"specserve serve lost a port {PORT_RETRIES + 1} times in a row:\n" + "".join(lines[-30:]))


@pytest.fixture(scope="session", params=FAMILIES)
def tiny_ckpt(request, tmp_path_factory):
    return make_tiny_checkpoint(tmp_path_factory.mktemp(request.param), request.param, seed=1)
