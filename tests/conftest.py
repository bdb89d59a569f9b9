"""Shared fixtures: tiny random checkpoints of each family, written with save_pretrained."""

from __future__ import annotations

import contextlib
import os
from pathlib import Path

# Tests run several torch processes at once on few cores (two xdist workers, each with its
# tritonservers and their Python-backend stubs). OpenMP's default wait policy spins an idle thread
# on its core for a while after each parallel region, burning a core another process needs, and
# a thread descheduled at a barrier stalls the whole region: beside other jobs on this 2-core
# machine test_triton_dflash.py took 142 CPU-s and 245 s spinning, 48 CPU-s and 115 s with
# PASSIVE. libgomp reads it when it loads, with torch (imported below); the servers the tests
# start inherit it. A value set by whoever runs the tests wins.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import pytest  # noqa: E402
import torch  # noqa: E402

# `specserve serve` as a child process (tests that serve through the CLI; benchmarks use it too).
from specserve.cli.serve_process import serve_process  # noqa: F401

# Tests use tiny tensors, where torch's intra-op thread pool only costs: with another process
# busy on the second core, a [4, 5] softmax took 4 ms with 2 threads and 1.4 us with 1.
torch.set_num_threads(1)
# The same for every process the tests start (tritonserver's model stubs, `specserve serve`,
# tensor-parallel workers): launch.server_env keeps a set OMP_NUM_THREADS, and with its default
# of 2 a stub's idle OpenMP worker spins beside the engine thread on a shared 2-core machine
# (measured: test_triton_eagle's fused tests 67 CPU s with 2, 37 s with 1; same outputs).
os.environ.setdefault("OMP_NUM_THREADS", "1")

FAMILIES = ("llama", "qwen2", "mistral")


def load_benchmark(name: str):
    """benchmarks/NAME.py as a module (benchmarks/ is no package), registered in sys.modules:
    dataclasses look their module up there."""
    import importlib.util
    import sys

    spec = importlib.util.spec_from_file_location(name, Path(__file__).resolve().parents[1] / "benchmarks" / f"{name}.py")
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod
    spec.loader.exec_module(mod)
    return mod


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
        srv.wait_ready(600)
        yield srv
    finally:
        srv.stop()


@pytest.fixture(scope="session", params=FAMILIES)
def tiny_ckpt(request, tmp_path_factory):
    return make_tiny_checkpoint(tmp_path_factory.mktemp(request.param), request.param, seed=1)


# The longest test files (make test's --durations, quiet 2-core machine), started first: with one
# file per xdist worker (--dist loadfile), a long file started last would leave one worker running
# it alone at the end. Within a file the order is kept (some files end on a test that kills a server).
LONGEST_FIRST = ("test_triton_eagle.py", "test_policy_recovery_triton.py", "test_reliability.py",
                 "test_triton_dflash.py", "test_smollm2.py", "test_eagle_triton_bench.py", "test_seeded_engine.py",
                 "test_bench_e2e.py", "test_static_step.py", "test_dspark.py", "test_quantize.py", "test_wheel.py",
                 "test_seeded.py", "test_tensor_parallel.py", "test_openai.py", "test_cli.py", "test_tiers_triton.py")


def pytest_collection_modifyitems(items):
    rank = {name: i for i, name in enumerate(LONGEST_FIRST)}
    items.sort(key=lambda item: rank.get(item.path.name, len(rank)))   # stable: file order kept otherwise
