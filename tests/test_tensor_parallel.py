"""Tensor parallelism on CPU: gloo, N = 2, tiny Llama (2 KV heads) and Qwen2 (4 KV heads, q/k/v
biases) checkpoints.

- the sharding plan splits each of q, k, v by heads and gate / up by features;
- the sharded target's logits equal the whole target's within fp32 tolerance (the all-reduces
  only reorder the sums: rtol = atol = 1e-5 on logits of magnitude ~5);
- an in-process engine built with tensor_parallel=2 decodes greedily token for token as N = 1
  does, for every method (none, ngram, eagle, dspark, mtp, dflash, draft);
- a killed worker fails the in-flight request with an error naming it, and every later step
  at once (no hang); the verifier service then refuses every request with it and says so once
  (on_broken); through tritonserver target_verifier unloads itself (not ready) and a load of it
  serves again;
- sampled output at N = 2 (eagle, draft) follows the exact target joint distribution
  (test_eagle's two_token_joint_tv);
- sizes that cannot shard are refused with a message saying why;
- through tritonserver (rank 0 inside target_verifier), every method's greedy text equals the
  in-process N = 1 engine's.

Each N = 2 target starts one worker process (a fresh interpreter: seconds).
"""

from __future__ import annotations

import dataclasses
import json
import os
import signal
import threading

import pytest
import torch

from conftest import make_served_checkpoint, make_tiny_checkpoint
from specserve.core.engine import Engine, EngineConfig, GenerationRequest
from specserve.core.engine_loop import EngineLoop
from specserve.core.sampling import SamplingParams
from specserve.methods.dflash.drafter import save_dflash
from specserve.methods.draft.drafter import save_draft_model
from specserve.methods.eagle.drafter import save_eagle
from specserve.model.tensor_parallel import Shard, TensorParallelError, check_tensor_parallel, shard_state
from specserve.model.tp_processes import start_tensor_parallel
from specserve.model.transformer import load_config, load_model
from specserve.serving.build import build_engine
from specserve.serving.settings import DeploymentSettings
from test_dflash import random_dflash
from test_eagle import random_drafter

FAMILIES = {"llama": dict(num_key_value_heads=2), "qwen2": dict(num_key_value_heads=4)}
PROMPTS = [[5, 17, 99, 3, 250, 42, 7, 7, 300, 12, 5, 17, 99], [11, 12, 13, 14, 11, 12, 13], [77],
           list(range(100, 130))]
N_TOKENS = 16
WAIT_S = 60   # a bounded wait for a killed worker to be reaped, or for the loop's failure callback


def write_served(root, family: str):
    """A served checkpoint (tokenizer beside it) and random EAGLE, DFlash and draft-model drafter
    folders (with EAGLE served, so are dspark and mtp)."""
    ckpt = make_served_checkpoint(root / "target", family, seed=7, **FAMILIES[family])
    target = load_model(ckpt)
    save_eagle(random_drafter(target, seed=3), json.loads((ckpt / "config.json").read_text()), root / "eagle")
    save_dflash(random_dflash(target, 2, num_layers=1, window=4, block_size=4), root / "dflash", dtype=torch.float32)
    draft = load_model(make_tiny_checkpoint(root / "draft-src", "llama", vocab_size=target.cfg.vocab_size, seed=9,
                                            num_hidden_layers=1, tie=True))
    save_draft_model(draft, root / "draft", tokenizer_from=ckpt, dtype=torch.float32)
    return ckpt, tuple((m, str(root / m)) for m in ("eagle", "dflash", "draft"))


@pytest.fixture(scope="module", params=sorted(FAMILIES))
def served(request, tmp_path_factory):
    return write_served(tmp_path_factory.mktemp(f"tp-{request.param}"), request.param)


def settings_for(served, n: int) -> DeploymentSettings:
    ckpt, drafters = served
    return DeploymentSettings(checkpoint=ckpt, drafters=drafters, tensor_parallel=n,
                              max_num_seqs=4, max_model_len=128, max_draft_len=4, device="cpu",
                              draft_policy="fixed", drafter_dtype="float32")


def test_plan_splits_q_k_v_by_heads_and_gate_up_by_features(tmp_path):
    ckpt = make_served_checkpoint(tmp_path, "qwen2", seed=1)   # H = 4, Hkv = 2, hd = 16, I = 128
    cfg = load_config(ckpt)
    whole = load_model(ckpt).state_dict()
    hd, I = cfg.head_dim, cfg.intermediate_size
    for rank in (0, 1):
        part = shard_state(whole, cfg, Shard(rank, 2))
        w = whole["layers.0.self_attn.qkv_proj.weight"]
        q, k, v = w[:4 * hd], w[4 * hd:6 * hd], w[6 * hd:]
        heads = slice(2 * rank * hd, 2 * (rank + 1) * hd)   # query heads 2r, 2r+1
        kv = slice(rank * hd, (rank + 1) * hd)              # KV head r
        assert torch.equal(part["layers.0.self_attn.qkv_proj.weight"], torch.cat([q[heads], k[kv], v[kv]]))
        b = whole["layers.0.self_attn.qkv_proj.bias"]
        assert torch.equal(part["layers.0.self_attn.qkv_proj.bias"],
                           torch.cat([b[:4 * hd][heads], b[4 * hd:6 * hd][kv], b[6 * hd:][kv]]))
        gu = whole["layers.0.mlp.gate_up_proj.weight"]
        half = slice(rank * I // 2, (rank + 1) * I // 2)
        assert torch.equal(part["layers.0.mlp.gate_up_proj.weight"], torch.cat([gu[:I][half], gu[I:][half]]))
        assert torch.equal(part["layers.0.self_attn.o_proj.weight"], whole["layers.0.self_attn.o_proj.weight"][:, heads])
        assert torch.equal(part["layers.0.mlp.down_proj.weight"], whole["layers.0.mlp.down_proj.weight"][:, half])
        assert part["embed_tokens.weight"] is whole["embed_tokens.weight"]   # replicated


@pytest.fixture(scope="module")
def engines(served):
    """(N = 1 engine, N = 2 engine) over the same checkpoint and drafters."""
    one, _ = build_engine(settings_for(served, 1))
    two, _ = build_engine(settings_for(served, 2))
    yield one, two
    two.model.close()


def test_sharded_logits_equal_whole(engines):
    one, two = engines
    assert two.model.world == 2 and two.cache.k.shape[2] == one.cache.k.shape[2] // 2   # this rank's KV heads
    tokens = torch.randint(0, one.model.cfg.vocab_size, (2, 12), generator=torch.Generator().manual_seed(0))
    torch.testing.assert_close(two.model.score(tokens), one.model.score(tokens), rtol=1e-5, atol=1e-5)


def test_every_method_greedy_equals_one_rank(engines):
    one, two = engines
    assert set(two.methods) == {"none", "ngram", "eagle", "dspark", "mtp", "dflash", "draft"}
    for method in two.methods:
        # spec_threshold 0: random drafters draft their full length instead of stopping at once.
        reqs = [GenerationRequest(f"{method}{i}", p, SamplingParams(max_tokens=N_TOKENS), method, spec_threshold=0.0)
                for i, p in enumerate(PROMPTS)]
        want, got = one.generate(reqs), two.generate(reqs)
        for r in reqs:
            assert got[r.request_id].new_token_ids == want[r.request_id].new_token_ids, (method, r.request_id)
        if method != "none":
            assert sum(o.stats.draft_tokens for o in got.values()) > 0, method


def test_killed_worker_fails_in_flight_requests_clearly(served):
    ckpt, _ = served
    target = start_tensor_parallel(ckpt, 2)
    engine = Engine(target, EngineConfig(max_num_seqs=2, max_model_len=128, max_draft_len=4), eos_token_ids=())
    held = threading.Event()
    held.set()
    failures: list[tuple[str, BaseException]] = []
    failed = threading.Event()

    def on_failure(rid, error):
        failures.append((rid, error))
        failed.set()

    loop = EngineLoop(engine, on_output=lambda out: None, on_failure=on_failure, hold=held.is_set).start()
    try:
        loop.submit(GenerationRequest("a", PROMPTS[0], SamplingParams(max_tokens=64), "none"))
        (pid,) = target.worker_pids
        os.kill(pid, signal.SIGKILL)
        target._workers[0].process.wait(WAIT_S)   # reaped: dead for sure before decoding goes on
        held.clear()
        assert failed.wait(WAIT_S)
        rid, error = failures[0]
        assert rid == "a" and isinstance(error, TensorParallelError)
        assert f"tensor-parallel worker rank 1 (pid {pid}) exited with code -9" in str(error)
        assert "reload the model" in str(error)
        loop.stop()   # the engine is the loop thread's until then
        # Later steps fail at once with the same error (no collective is waited on).
        with pytest.raises(TensorParallelError, match="rank 1"):
            engine.generate([GenerationRequest("b", [1, 2, 3], SamplingParams(max_tokens=2), "none")])
    finally:
        loop.stop()
        target.close()


@pytest.mark.parametrize("world, why", [
    (0, "at least 1"),
    (3, "does not divide the model's 4 query heads"),
    (4, "does not divide the model's 2 KV heads"),
])
def test_sizes_that_cannot_shard_are_refused(tmp_path, world, why):
    cfg = load_config(make_served_checkpoint(tmp_path, "llama", seed=1))   # H = 4, Hkv = 2
    with pytest.raises(ValueError, match=why):
        check_tensor_parallel(cfg, world, torch.device("cpu"), "none")


def test_quantized_and_too_many_gpus_are_refused(tmp_path, monkeypatch):
    cfg = load_config(make_served_checkpoint(tmp_path, "llama", seed=1))
    with pytest.raises(ValueError, match="quantize=int8 is not supported yet"):
        check_tensor_parallel(cfg, 2, torch.device("cpu"), "int8")
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    with pytest.raises(ValueError, match="needs 2 GPUs from cuda:0; this machine has 1"):
        check_tensor_parallel(cfg, 2, torch.device("cuda", 0), "none")


def test_serve_refuses_a_size_that_cannot_shard_before_any_server(tmp_path):
    from specserve.cli.checks import CliError
    from specserve.cli.main import build_parser, serve_settings

    ckpt = make_served_checkpoint(tmp_path / "target", "llama", seed=1)   # 2 KV heads
    args = build_parser().parse_args(["serve", "--target", str(ckpt), "--no-text-gate", "--device", "cpu",
                                      "--tensor-parallel", "4"])
    with pytest.raises(CliError, match="--tensor-parallel: tensor_parallel=4 does not divide the model's 2 KV heads"):
        serve_settings(args)
    args = build_parser().parse_args(["serve", "--target", str(ckpt), "--no-text-gate", "--device", "cpu",
                                      "--tensor-parallel", "2"])
    assert serve_settings(args)[0].tensor_parallel == 2


def test_every_method_through_tritonserver_equals_one_rank(tmp_path):
    from conftest import running_server
    from specserve.triton.client import StreamClient
    from specserve.triton.render import render_repository

    served = write_served(tmp_path, "llama")
    settings = dataclasses.replace(settings_for(served, 2), mtp_placement="fused")
    one, tokenizer = build_engine(dataclasses.replace(settings, tensor_parallel=1))
    prompt = "The quick brown fox jumps over the lazy dog. The quick brown"
    ids = tokenizer.encode(prompt).ids
    want = {m: tokenizer.decode(one.generate([GenerationRequest(m, ids, SamplingParams(max_tokens=N_TOKENS), m)])[m]
                                .new_token_ids, skip_special_tokens=True) for m in one.methods}
    with running_server(render_repository(settings, tmp_path / "model_repository"), tmp_path) as server:
        client = StreamClient(server.grpc_url)
        got = {m: client.generate(prompt, {"max_tokens": N_TOKENS, "spec_method": m}).text for m in want}
    assert set(got) == {"none", "ngram", "eagle", "dspark", "mtp", "dflash", "draft"} and got == want
    assert "tensor-parallel target: 2 ranks" in (tmp_path / "tritonserver.log").read_text()


def dead_worker_error(pid: int) -> str:
    return (f"tensor-parallel worker rank 1 (pid {pid}) exited with code -9: the 2-way tensor-parallel target "
            "cannot run without it; reload the model to start new workers")


def test_a_dead_worker_breaks_the_service_for_good(served, tmp_path, monkeypatch):
    """The verifier service over a 2-way target: a worker killed mid-stream ends the stream with the
    error, calls on_broken once (the adapter's unload) and refuses every later request with it."""
    from specserve.core.engine import RequestRejected
    from specserve.serving.params import RequestConfig
    from specserve.serving.verifier_service import ENGINE_FAILED, HOLD_FILE_ENV, VerifierService
    from test_triton_adapters import FakeSender

    hold = tmp_path / "hold"
    hold.touch()   # after its first token the stream takes no step: it is in flight when the worker dies
    monkeypatch.setenv(HOLD_FILE_ENV, str(hold))
    broken: list[str] = []
    service = VerifierService(lambda: build_engine(settings_for(served, 2))[0], on_broken=broken.append)
    try:
        sender = FakeSender()
        first = threading.Event()
        sender.send = lambda r, send=sender.send: (send(r), first.set())
        service.submit(PROMPTS[0], RequestConfig(sampling={"max_tokens": 64}, stream=True), sender)
        assert first.wait(WAIT_S)
        (pid,) = service.engine.model.worker_pids
        os.kill(pid, signal.SIGKILL)
        assert sender.done.wait(WAIT_S)   # the watcher saw the death: no step needed
        why = dead_worker_error(pid)
        final = sender.responses[-1]
        assert final.final and final.meta.error == ENGINE_FAILED.format(why) and not sender.errors
        assert broken == [why] and service.broken == why
        with pytest.raises(RequestRejected) as refused:
            service.submit([1, 2, 3], RequestConfig(sampling={"max_tokens": 2}), FakeSender())
        assert str(refused.value) == why
    finally:
        service.stop()   # stops the target's workers too


def test_a_dead_worker_turns_target_verifier_not_ready_and_a_load_serves_again(tmp_path, monkeypatch):
    """Through tritonserver (explicit model control, as `specserve serve` runs it): a worker killed
    mid-stream ends the stream with the error, target_verifier unloads itself (not ready), and
    model control's load of it serves again, the same text as before."""
    import queue
    import re
    import time

    import tritonclient.grpc as grpcclient

    from conftest import running_server
    from specserve.cli.main import SERVE_TRITON_ARGS
    from specserve.triton.client import CompletionError, StreamClient
    from specserve.triton.render import render_repository
    from specserve.serving.verifier_service import HOLD_FILE_ENV

    ckpt = make_served_checkpoint(tmp_path / "target", "llama", seed=7, **FAMILIES["llama"])
    settings = DeploymentSettings(checkpoint=ckpt, tensor_parallel=2, max_num_seqs=2, max_model_len=128, device="cpu",
                                  draft_policy="fixed")
    hold = tmp_path / "hold"
    monkeypatch.setenv(HOLD_FILE_ENV, str(hold))   # tritonserver and its models inherit it
    prompt, sampling = "The quick brown fox jumps over the lazy dog. The quick brown", {"max_tokens": N_TOKENS}
    log = tmp_path / "tritonserver.log"
    with running_server(render_repository(settings, tmp_path / "model_repository"), tmp_path,
                        SERVE_TRITON_ARGS) as server:
        client, admin = grpcclient.InferenceServerClient(server.grpc_url), server.admin_headers
        want = StreamClient(server.grpc_url).generate(prompt, sampling).text
        (pid,) = map(int, re.findall(r"worker pids \[(\d+)\]", log.read_text()))

        hold.touch()   # after its first token the stream takes no step: in flight when the worker dies
        started, result = threading.Event(), queue.Queue()

        def stream():
            try:
                result.put(StreamClient(server.grpc_url).generate(prompt, {"max_tokens": 64}, timeout=600,
                                                                   on_chunk=lambda c: started.set()))
            except CompletionError as e:
                result.put(e)

        threading.Thread(target=stream, daemon=True).start()
        assert started.wait(120)
        os.kill(pid, signal.SIGKILL)
        got = result.get(timeout=120)
        assert isinstance(got, CompletionError)
        assert str(got) == f"in ensemble 'llm', the engine failed while running this request: {dead_worker_error(pid)}"
        deadline = time.monotonic() + 120   # a bound on the unload, not a timing assumption
        while client.is_model_ready("target_verifier"):
            assert time.monotonic() < deadline, "target_verifier still ready after its worker died"
            time.sleep(0.2)
        assert not client.is_model_ready("llm")
        hold.unlink()

        client.load_model("target_verifier", headers=admin)   # new engine, new worker
        assert client.is_model_ready("target_verifier")
        assert StreamClient(server.grpc_url).generate(prompt, sampling).text == want
    text = log.read_text()
    assert "target_verifier unloads itself: Triton reports it not ready until model control loads it again" in text
    assert len(re.findall(r"tensor-parallel target: 2 ranks", text)) == 2


# -- sampled output at N = 2: test_eagle's joint-distribution check -----------------------------------

@pytest.fixture(scope="module")
def small_tp(tmp_path_factory):
    """test_eagle's vocab-8 target, whole (for the exact joint) and sharded over 2 ranks."""
    ckpt = make_tiny_checkpoint(tmp_path_factory.mktemp("tp-small") / "t", "llama", vocab_size=8, seed=5)
    target = start_tensor_parallel(ckpt, 2)
    yield load_model(ckpt), target
    target.close()


# One method: every method's rows go through the same verification and sampler, and what N = 2
# changes is only the target's probabilities they read (the draft method passed too, when run).
@pytest.mark.parametrize("method", ["eagle"])
def test_sampled_output_at_two_ranks_follows_the_target_distribution(small_tp, tmp_path, method):
    """The joint of tokens 2 and 3 (drafted and verified in one step) generated by the 2-way
    target against the exact joint of the whole target: test_eagle.two_token_joint_tv, with its
    3000 requests and its bound. That the check catches a broken sampler is shown where it is
    defined for one rank (test_mtp's and test_eagle3's broken variants); what N = 2 adds is the
    sharded target's probabilities, the same check's input."""
    from specserve.methods.draft.proposer import DraftModelProposer
    from specserve.methods.eagle.proposer import EagleProposer
    from test_eagle import two_token_joint_tv

    whole, target = small_tp
    # Many rows a step: each step pays the all-reduces' latency, not the rows' arithmetic.
    cfg = dict(max_num_seqs=256, max_model_len=64, max_draft_len=2)
    if method == "eagle":
        proposer = EagleProposer(random_drafter(whole, seed=2, calibration=False), target, threshold=None, **cfg)
    else:
        draft = load_model(make_tiny_checkpoint(tmp_path / "d", "llama", vocab_size=8, seed=9))
        proposer = DraftModelProposer(draft, **cfg)
    engine = Engine(target, EngineConfig(**cfg), {method: proposer}, eos_token_ids=())
    tv = two_token_joint_tv(whole, engine, method)
    assert tv < 0.06, f"total variation {tv:.4f}"
