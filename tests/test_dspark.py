"""DSPark (specserve.methods.dspark.proposer) in process: greedy equals plain decoding (tiny model with a
random drafter, and the demo model with its trained drafter), sampled output follows the target
distribution and is reproducible per seed; the graph wrapper's CPU eager mode; CUDA-only checks
(graph replay equals eager, no host sync inside a replay) skip visibly without a GPU."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from conftest import make_tiny_checkpoint
from specserve.core.cuda_graphs import GraphCache
from specserve.core.engine import Engine, EngineConfig, GenerationRequest
from specserve.model.transformer import load_model
from specserve.methods.dspark.head import DraftHead
from specserve.methods.dspark.proposer import DSParkProposer, StepKey, draft_lengths
from specserve.methods.eagle.drafter import load_eagle
from specserve.methods.eagle.proposer import EagleProposer
from specserve.core.sampling import SamplingParams
from specserve.core.static_step import to_host
from test_eagle import random_drafter, two_token_joint_tv
from test_eagle3 import LAYERS, fitted_eagle3, random_eagle3

ROOT = Path(__file__).resolve().parents[1]
DEMO = ROOT / "models" / "demo"
PROMPTS = [[5, 17, 99, 3, 250, 42, 7, 7, 300, 12, 64, 128, 5, 17, 99], [11, 12, 13, 14, 11, 12, 13],
           [400, 3, 3, 3, 3, 3, 3, 3], [77], list(range(100, 160))]
CUDA = torch.cuda.is_available()
needs_cuda = pytest.mark.skipif(not CUDA, reason="needs a CUDA GPU (run `make gpu-check` on a GPU machine)")


@pytest.fixture(scope="module")
def target(tmp_path_factory):
    return load_model(make_tiny_checkpoint(tmp_path_factory.mktemp("dspark"), "llama", seed=21))


def engine_with(target, drafter, *, threshold, max_num_seqs=4, max_draft_len=5, max_model_len=256,
                device=None, graph_mode="auto"):
    kw = dict(max_num_seqs=max_num_seqs, max_model_len=max_model_len, max_draft_len=max_draft_len,
              threshold=threshold)
    proposers = {"dspark": DSParkProposer(drafter, target, graph_mode=graph_mode, **kw),
                 "eagle": EagleProposer(drafter, target, **kw)}
    return Engine(target, EngineConfig(max_num_seqs=max_num_seqs, max_model_len=max_model_len,
                                       max_draft_len=max_draft_len), proposers, eos_token_ids=())


def reqs(method, prompts, n=20, **kw):
    return [GenerationRequest(f"{method}{i}", p, SamplingParams(max_tokens=n, **kw), method)
            for i, p in enumerate(prompts)]


def test_draft_length_set():
    assert draft_lengths(8) == tuple(range(1, 9)) and draft_lengths(1) == (1,)


@pytest.mark.parametrize("threshold", [None, 0.2])
def test_greedy_dspark_equals_plain_and_eagle(target, threshold):
    """Five requests on four slots (one waits and joins mid-run; buckets 4 and 2 with padded rows)."""
    engine = engine_with(target, random_drafter(target, seed=1), threshold=threshold)
    plain, spec, eagle = (engine.generate(reqs(m, PROMPTS)) for m in ("none", "dspark", "eagle"))
    for i in range(len(PROMPTS)):
        assert spec[f"dspark{i}"].new_token_ids == plain[f"none{i}"].new_token_ids, f"prompt {i}"
        # Same drafter, same cut rule: the same drafts, so the same acceptance.
        assert spec[f"dspark{i}"].stats.accepted_tokens == eagle[f"eagle{i}"].stats.accepted_tokens
    assert sum(o.stats.draft_tokens for o in spec.values()) > 0
    assert engine.num_free_slots == 4 and engine.proposers["dspark"].eagle.cache.num_free == 4


def test_greedy_steps_run_the_graphs_warm_made(target):
    """warm() makes the greedy keys at the full span (what a GPU serves) before any request; greedy
    steps must find them, not make graphs of their own on a request's path."""
    kw = dict(max_num_seqs=4, max_model_len=256, max_draft_len=5, threshold=0.3)
    prop = DSParkProposer(random_drafter(target, seed=1), target, span_set="full", **kw)
    engine = Engine(target, EngineConfig(max_num_seqs=4, max_model_len=256, max_draft_len=5),
                    {"dspark": prop}, eos_token_ids=())
    prop.warm()
    warmed = set(prop._graphs.graphs)
    engine.generate(reqs("dspark", PROMPTS))
    assert set(prop._graphs.graphs) == warmed


def test_bf16_drafter_keeps_greedy_output(target):
    drafter = random_drafter(target, seed=4).to(torch.bfloat16)
    drafter.calibration.float()
    engine = engine_with(target, drafter, threshold=0.2)
    plain, spec = engine.generate(reqs("none", PROMPTS[:3])), engine.generate(reqs("dspark", PROMPTS[:3]))
    assert [spec[f"dspark{i}"].new_token_ids for i in range(3)] == [plain[f"none{i}"].new_token_ids for i in range(3)]


def test_num_draft_tokens_and_room_cap_the_draft(target):
    engine = engine_with(target, random_drafter(target, seed=1), threshold=None)
    r = GenerationRequest("a", PROMPTS[0], SamplingParams(max_tokens=12), "dspark", num_draft_tokens=2)
    out = engine.generate([r])["a"]
    assert out.stats.draft_tokens <= 2 * out.stats.steps and len(out.new_token_ids) == 12
    assert engine.generate(reqs("none", PROMPTS[:1], 12))["none0"].new_token_ids == out.new_token_ids


def test_seeded_sampled_request_repeats(target):
    engine = engine_with(target, random_drafter(target, seed=1), threshold=0.2)
    run = lambda seed: engine.generate(reqs("dspark", PROMPTS[:2], 24, temperature=0.9, top_k=40,
                                            seed=seed))
    a, b, c = run(3), run(3), run(4)
    assert [a[k].new_token_ids for k in a] == [b[k].new_token_ids for k in a]
    assert [a[k].new_token_ids for k in a] != [c[k].new_token_ids for k in a]


def test_sampled_dspark_follows_target_distribution(tmp_path):
    """Joint of generated tokens 2 and 3 (drafted and verified in one step) vs the exact target,
    as test_eagle does for the dynamic path."""
    target = load_model(make_tiny_checkpoint(tmp_path / "small", "llama", vocab_size=8, seed=5))
    engine = engine_with(target, random_drafter(target, seed=2, calibration=False), threshold=None,
                         max_num_seqs=64, max_draft_len=2)
    tv = two_token_joint_tv(target, engine, "dspark")
    assert tv < 0.06, f"total variation {tv:.4f}"


@pytest.mark.skipif(not (DEMO / "eagle" / "config.json").is_file(), reason="demo checkpoints absent")
def test_demo_dspark_greedy_equals_none():
    from specserve.model.tokenizer import load_tokenizer

    target = load_model(DEMO / "target")
    drafter = load_eagle(DEMO / "eagle", target, dtype=torch.float32)
    tok = load_tokenizer(DEMO / "target")
    held = [json.loads(line) for line in (DEMO / "heldout_prompts.jsonl").read_text().splitlines()]
    prompts = [next(h for h in held if h["kind"] == k)["prompt"] for k in ("code", "prose")]
    ids = [tok.encode(p).ids for p in prompts]
    engine = engine_with(target, drafter, threshold=0.3, max_num_seqs=2, max_draft_len=8, max_model_len=512)
    plain, spec = engine.generate(reqs("none", ids, 40)), engine.generate(reqs("dspark", ids, 40))
    for i in range(2):
        assert spec[f"dspark{i}"].new_token_ids == plain[f"none{i}"].new_token_ids
    assert sum(o.stats.accepted_tokens for o in spec.values()) > 20  # the trained drafter is accepted


def test_graph_cache_eager_mode_reuses_static_buffers():
    calls = []

    def make_fn(key):
        def fn(x):
            calls.append(key)
            return {"y": x["a"] * key}
        return fn

    cache = GraphCache(make_fn, lambda key: {"a": torch.zeros(3)}, torch.device("cpu"))
    assert not cache.capture
    out = cache.run(2, {"a": torch.tensor([1.0, 2.0, 3.0])})
    assert out["y"].tolist() == [2.0, 4.0, 6.0]
    assert cache.graphs[2].inputs["a"].tolist() == [1.0, 2.0, 3.0]  # copied into the static buffer
    with pytest.raises(ValueError, match="needs a CUDA device"):
        GraphCache(make_fn, lambda key: {}, torch.device("cpu"), mode="graph")


def test_dynamic_rope_is_refused(tmp_path):
    path = make_tiny_checkpoint(tmp_path / "ntk", "llama", seed=2,
                                rope_scaling={"rope_type": "dynamic", "factor": 2.0})
    target = load_model(path)
    with pytest.raises(ValueError, match="dynamic NTK RoPE"):
        DSParkProposer(random_drafter(target, seed=1), target, max_num_seqs=2, max_model_len=128)


# -- with an EAGLE-3 drafter (fused target layers, its own reduced-vocabulary head) -------------------

@pytest.fixture(scope="module", params=["llama", "qwen2"])
def target4(request, tmp_path_factory):
    """Four layers: room for a distinct low, middle and high layer (test_eagle3.LAYERS)."""
    path = make_tiny_checkpoint(tmp_path_factory.mktemp(f"dspark3_{request.param}"), request.param, seed=21,
                                num_hidden_layers=LAYERS)
    return load_model(path)


@pytest.fixture(scope="module")
def fitted3(target4):
    """An EAGLE-3 drafter on layers 0, 1 and 3 over 128 of the 512 target ids, its head fitted
    to the target's greedy output for PROMPTS (so its drafts are accepted there)."""
    plain = Engine(target4, EngineConfig(max_num_seqs=4, max_model_len=256), {}, eos_token_ids=())
    out = plain.generate(reqs("none", PROMPTS, 24))
    return fitted_eagle3(target4, [p + out[f"none{i}"].new_token_ids for i, p in enumerate(PROMPTS)], 128)


def test_draft_head_maps_draft_ids_through_d2t(tmp_path):
    """head.py's worked example: target ids [2, 3, 5] of a vocabulary of 8."""
    target = load_model(make_tiny_checkpoint(tmp_path, "llama", vocab_size=8, seed=5, num_hidden_layers=LAYERS))
    drafter = random_eagle3(target, seed=1, draft_size=3)
    drafter.set_vocab(torch.tensor([2, 2, 3]), torch.tensor([0, 0, 1, 1, 0, 1, 0, 0], dtype=torch.bool))
    head = DraftHead(drafter, None)
    logits = torch.tensor([[0.1, 1.5, -0.2]])
    assert head.to_target(logits.argmax(-1)).tolist() == [3]
    q = head.expand(logits.softmax(-1))
    torch.testing.assert_close(q, drafter.to_target(logits).softmax(-1))   # the dynamic proposer's q
    assert q[0, [0, 1, 4, 6, 7]].tolist() == [0.0] * 5
    noise = torch.arange(8.0)[None]
    assert head.draft_noise(noise).tolist() == [[2.0, 3.0, 5.0]]
    with pytest.raises(ValueError, match="an EAGLE-3 one with its own"):
        DraftHead(drafter, target.lm_head.weight)


@pytest.mark.parametrize("threshold", [None, 0.2])
def test_greedy_dspark_with_eagle3_equals_plain_and_eagle(target4, fitted3, threshold):
    """Five requests on four slots, as for EAGLE-1 above; the drafts are accepted, and DSPark's
    equal the dynamic path's (fused layers kept by the static step, its own head, d2t)."""
    engine = engine_with(target4, fitted3, threshold=threshold)
    assert engine.proposers["dspark"].feature_layers == (0, 1, 3)
    plain, spec, eagle = (engine.generate(reqs(m, PROMPTS)) for m in ("none", "dspark", "eagle"))
    for i in range(len(PROMPTS)):
        assert spec[f"dspark{i}"].new_token_ids == plain[f"none{i}"].new_token_ids, f"prompt {i}"
        # Same drafter, same cut rule: the same drafts, so the same acceptance as the dynamic path.
        assert spec[f"dspark{i}"].stats.accepted_tokens == eagle[f"eagle{i}"].stats.accepted_tokens
    assert sum(o.stats.draft_tokens for o in spec.values()) > 0
    assert sum(o.stats.accepted_tokens for o in spec.values()) > 0
    assert engine.num_free_slots == 4 and engine.proposers["dspark"].eagle.cache.num_free == 4


def test_seeded_dspark_with_eagle3_equals_seeded_plain(target4, fitted3):
    engine = engine_with(target4, fitted3, threshold=0.2)
    run = lambda m: engine.generate(reqs(m, PROMPTS[:3], 24, temperature=0.9, top_k=40, seed=3))  # noqa: E731
    plain, spec = run("none"), run("dspark")
    assert [spec[f"dspark{i}"].new_token_ids for i in range(3)] == [plain[f"none{i}"].new_token_ids for i in range(3)]
    assert sum(o.stats.draft_tokens for o in spec.values()) > 0


class _WrongQHead(DraftHead):
    """Broken on purpose (test_eagle3._WrongQ's fault in the static step): tokens are picked from
    q over the draft ids and mapped right, but the q verification reads is expanded with a wrong
    d2t (each draft id's probability lands on the next draft id's target token)."""

    def expand(self, q_d):
        return super().expand(q_d.roll(1, -1))


@pytest.mark.parametrize("params", [dict(temperature=1.0, top_k=6), dict(temperature=0.7)], ids=["top-k", "plain"])
@pytest.mark.parametrize("broken", [False, True], ids=["exact", "broken-d2t-q"])
def test_sampled_dspark_with_eagle3_follows_target_distribution(tmp_path, broken, params):
    """test_eagle's joint of tokens 2 and 3 against the exact target, drafted from 5 of the 8
    target ids (the target's mass outside them is only reachable through recovery); the same
    check must catch the wrongly expanded q. "plain" (no top-k / top-p) runs the step's
    sort-free warp (StepKey.truncated False), "top-k" the sorting one."""
    target = load_model(make_tiny_checkpoint(tmp_path / "small", "llama", vocab_size=8, seed=5,
                                             num_hidden_layers=LAYERS))
    drafter = random_eagle3(target, seed=2, draft_size=5, calibration=False, head_scale=1.0)
    engine = engine_with(target, drafter, threshold=None, max_num_seqs=64, max_draft_len=2)
    prop = engine.proposers["dspark"]
    if broken:
        prop.head = _WrongQHead(drafter, None)
    tv = two_token_joint_tv(target, engine, "dspark", params=params)
    # the sampled steps ran the variant these parameters choose
    assert {k.truncated for k in prop._graphs.graphs if k.sampled} == {"top_k" in params}
    if broken:
        assert tv > 0.1, f"the broken variant went unnoticed: total variation {tv:.4f}"
    else:
        assert tv < 0.06, f"total variation {tv:.4f}"


# -- CUDA only ----------------------------------------------------------------------------------------

def _cuda_engine(graph_mode, drafter_kind="eagle1"):
    """The demo target with its EAGLE-1 drafter, or with a random EAGLE-3 one (layers 0, 9 and 17,
    a quarter of the vocabulary: the captured step's fused layers and d2t mapping)."""
    target = load_model(DEMO / "target", device="cuda")
    if drafter_kind == "eagle1":
        drafter = load_eagle(DEMO / "eagle", target, dtype=torch.float32)
    else:
        L = target.cfg.num_layers
        drafter = random_eagle3(target, seed=1, draft_size=target.cfg.vocab_size // 4,
                                layers=(0, L // 2, L - 1)).to("cuda")
    return target, engine_with(target, drafter, threshold=0.3, max_num_seqs=4, max_draft_len=8,
                               max_model_len=512, graph_mode=graph_mode)


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("drafter_kind", ["eagle1", "eagle3"])
def test_cuda_graph_replay_equals_eager_and_plain(drafter_kind):
    prompts = [PROMPTS[0], PROMPTS[1], PROMPTS[4]]
    _, graphed = _cuda_engine("graph", drafter_kind)
    _, eager = _cuda_engine("eager", drafter_kind)
    plain = graphed.generate(reqs("none", prompts, 48))
    g, e = graphed.generate(reqs("dspark", prompts, 48)), eager.generate(reqs("dspark", prompts, 48))
    for i in range(len(prompts)):
        assert g[f"dspark{i}"].new_token_ids == e[f"dspark{i}"].new_token_ids == plain[f"none{i}"].new_token_ids
    assert graphed.proposers["dspark"]._graphs.capture and not eager.proposers["dspark"]._graphs.capture


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("drafter_kind", ["eagle1", "eagle3"])
def test_cuda_graph_replay_has_no_host_sync(drafter_kind):
    """A captured step, run as the proposer runs it (its device inputs copied into the graph's
    buffers, then the replay), makes no synchronising CUDA call; the step's one host sync is the
    read of its outputs (static_step.to_host), which the same check catches, so it is live."""
    _, engine = _cuda_engine("graph", drafter_kind)
    prop = engine.proposers["dspark"]
    engine.generate(reqs("dspark", PROMPTS[:2], 8))  # captures the keys it uses
    key, graph = next(iter(prop._graphs.graphs.items()))
    assert isinstance(key, StepKey) and graph.graph is not None   # captured, not run eagerly
    inputs = prop._example(key)   # on the device, like the inputs the proposer builds per step
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        out = prop._graphs.run(key, inputs)["out"]   # raises on any synchronising call
        with pytest.raises(RuntimeError, match="called a synchronizing CUDA operation"):
            to_host(out)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    torch.cuda.synchronize()
    assert to_host(out).shape[0] == key.B


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("method", ["eagle", "ngram"])
def test_cuda_fp32_methods_equal_none(method):
    from specserve.methods.ngram.proposer import NgramProposer

    target, engine = _cuda_engine("graph")
    engine.proposers["ngram"] = NgramProposer()
    plain, spec = engine.generate(reqs("none", PROMPTS, 32)), engine.generate(reqs(method, PROMPTS, 32))
    for i in range(len(PROMPTS)):
        assert spec[f"{method}{i}"].new_token_ids == plain[f"none{i}"].new_token_ids


# -- through a real tritonserver ----------------------------------------------------------------------

@pytest.mark.triton
@pytest.mark.skipif(not (DEMO / "eagle" / "config.json").is_file(), reason="demo checkpoints absent")
def test_triton_dspark_greedy_equals_none(tmp_path):
    from specserve.triton.client import StreamClient
    from specserve.triton.launch import TritonServer
    from specserve.serving.settings import DeploymentSettings
    from specserve.triton.render import render_repository

    repo = render_repository(DeploymentSettings(DEMO / "target", max_num_seqs=4, max_model_len=512, max_draft_len=8,
                                                default_method="eagle", drafters=(("eagle", str(DEMO / "eagle")),),
                                                device="cpu", draft_policy="fixed",
                                                mtp_placement="fused"),   # mtp is not served here
                             tmp_path / "model_repository")
    srv = TritonServer(repo, tmp_path, None, log_file=tmp_path / "tritonserver.log", exit_timeout_s=5)
    srv.start()
    try:
        srv.wait_ready(600)   # a bound for a busy machine, not a timing assumption
        held = [json.loads(line) for line in (DEMO / "heldout_prompts.jsonl").read_text().splitlines()]
        prompts = [next(h for h in held if h["kind"] == k)["prompt"] for k in ("code", "prose")]
        client = StreamClient(srv.grpc_url)
        for p in prompts:
            plain = client.generate(p, {"max_tokens": 48, "spec_method": "none"})
            spec = client.generate(p, {"max_tokens": 48, "spec_method": "dspark"})
            assert spec.text == plain.text, p
            assert spec.spec_stats["method"] == "dspark" and spec.spec_stats["accepted_tokens"] > 0
    finally:
        srv.stop()


# -- make gpu-check: its CPU-runnable parts ---------------------------------------------------------

def test_gpu_check_table_on_a_tiny_model(tmp_path):
    import importlib.util

    spec = importlib.util.spec_from_file_location("gpu_check", ROOT / "benchmarks" / "gpu_check.py")
    gpu_check = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(gpu_check)
    args = gpu_check.parse_args(["--tiny", "--device", "cpu", "--dtype", "float32", "--batches", "1,2",
                                 "--ks", "1,2", "--no-hf", "--out", str(tmp_path)])
    assert args.batches == [1, 2] and args.ks == [1, 2] and gpu_check.parse_args([]).device == "cuda"
    assert gpu_check.main(["--tiny", "--device", "cpu", "--dtype", "float32", "--batches", "1,2", "--ks", "1,2",
                           "--no-hf", "--out", str(tmp_path)]) == 0
    table = (tmp_path / "table.md").read_text()
    report = json.loads((tmp_path / "timing.json").read_text())
    assert set(report["step_ms"]) == {f"B={b},K={k}" for b in (1, 2) for k in (0, 1, 2)}
    assert "| 2 |" in table and "dspark / eagle ITL std" in table
    assert set(report["methods"]["B=2"]) == {"none", "eagle", "dspark"}
    # The tensor-parallel check needs CUDA: on CPU it skips, and the report and the table say why.
    assert report["tensor_parallel"] == {"skipped": "not on CUDA (--device cpu): NCCL needs GPUs"}
    assert "Skipped: not on CUDA (--device cpu): NCCL needs GPUs." in table
