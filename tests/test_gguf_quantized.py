"""import-gguf --keep-quantized: tiny GGUF files the test writes (tests/tiny_gguf.py) with Q4_1 /
Q4_0 projections are served on the int4 kernel as the file stores them — in float32 the kernel's
weights are gguf's dequantized weights bit for bit, in bfloat16 its scales and zeros round as
the import reports; the logits match transformers' own (dequantized) GGUF load; greedy
speculative output equals plain output of the same kept target; Q8_0 and K-quant projections,
and --quantize on a kept folder, are refused with exact messages."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import transformers

from specserve.cli.main import main
from specserve.core.engine import GenerationRequest
from specserve.core.sampling import SamplingParams
from specserve.model.gguf_import import GGUFImportError, import_gguf
from specserve.model.gguf_q4 import KeptReport
from specserve.model.q4_checkpoint import KEPT_FILE, Q4Weights, kernel_weight, take_stored
from specserve.model.quantize import Quantization, QuantizeError, served_quantization
from specserve.model.quantized_linear import Int4Linear
from specserve.model.transformer import load_model
from tiny_gguf import write_tiny_gguf

PROMPT = [1, 57, 220, 301, 14, 99, 7, 300, 250]
# Our fp32 transformer against transformers' on the same weights: matmul order only
# (test_gguf_import.py's tolerance).
LOGITS_TOL = 1e-4
# The int4 kernel accumulates in fp32 in its own order; against an fp64 matmul with the same
# weights that is rounding only: 1e-5 of the output's scale (test_quantize.py's tolerance).
MATMUL_TOL = 1e-5
PARTS = {"self_attn.qkv_proj": ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"),
         "self_attn.o_proj": ("self_attn.o_proj",), "mlp.gate_up_proj": ("mlp.gate_proj", "mlp.up_proj"),
         "mlp.down_proj": ("mlp.down_proj",)}


def gguf_reference(path: Path):
    """transformers' own load of the GGUF file (dequantized by the gguf package), fp32."""
    return transformers.AutoModelForCausalLM.from_pretrained(
        str(path.parent), gguf_file=path.name, dtype=torch.float32).eval()


@pytest.fixture(scope="module", params=[("llama", "Q4_1"), ("qwen2", "Q4_0")], ids=["llama-Q4_1", "qwen2-Q4_0"])
def kept(request, tmp_path_factory):
    """(GGUF file, its --keep-quantized import, transformers' dequantized load of the file)."""
    arch, qtype = request.param
    tmp = tmp_path_factory.mktemp(f"kept_{arch}")
    src = write_tiny_gguf(tmp / f"{arch}.gguf", arch=arch, qtype=qtype, seed=4)
    out = tmp / "imported"
    import_gguf(src, out, keep_quantized=True)
    return src, out, gguf_reference(src)


def gguf_weight(ref, layer: int, fused: str) -> torch.Tensor:
    """transformers' dequantized weight [N, K] of our fused projection `fused`."""
    state = ref.state_dict()
    return torch.cat([state[f"model.layers.{layer}.{p}.weight"] for p in PARTS[fused]])


def test_the_folder_stores_the_files_integers_and_records_it(kept):
    src, out, _ = kept
    record = json.loads((out / KEPT_FILE).read_text())
    qtype = "Q4_1" if "llama" in src.name else "Q4_0"
    assert (record["quant_method"], record["bits"], record["group_size"]) == ("specserve_gguf_int4", 4, 32)
    assert record["source"] == {"gguf": src.name, "types": {qtype: 14}}   # 2 layers x 7 projections
    assert record["max_abs_diff_vs_gguf"]["float32"] == 0 and record["inexact_float32_zeros"] == 0
    from safetensors.torch import load_file

    state = load_file(str(out / "model.safetensors"))
    assert "model.layers.0.self_attn.q_proj.weight" not in state
    q_proj = take_stored(state, "model.layers.0.self_attn.q_proj")
    assert q_proj.q.shape == (64, 64) and q_proj.scales.dtype == torch.float16 and int(q_proj.q.max()) <= 15
    assert state["model.embed_tokens.weight"].dtype == torch.float32   # dense, dequantized


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_kept_linears_are_gguf_dequantized_weights(kept, dtype):
    """Read through the kernel (an identity batch returns the weight it multiplies by): bit for bit
    gguf's dequantization in float32; in bfloat16 the weight of bf16-rounded scales and zeros, as
    kernel_weight (and so the import report) computes it, rounded to the bf16 output."""
    src, out, ref = kept
    model = load_model(out, dtype=dtype)
    report = KeptReport.of_folder(out)
    stored = _stored(out)
    for i, layer in enumerate(model.layers):
        for fused in PARTS:
            module = layer.get_submodule(fused)
            assert isinstance(module, Int4Linear)
            want = gguf_weight(ref, i, fused)                                   # [N, K]
            eye = torch.eye(module.in_features, dtype=dtype)                  # [K, K]; no bias added
            seen = torch.ops.aten._weight_int4pack_mm_for_cpu(eye, module.weight_int4, 32, module.scales_and_zeros)
            seen = seen.T.float()                                              # [N, K]
            if dtype == torch.float32:
                assert torch.equal(seen, want), (i, fused)
            else:
                parts = [take_stored(dict(stored), f"model.layers.{i}.{p}") for p in PARTS[fused]]
                w = Q4Weights(*(torch.cat([getattr(p, f) for p in parts]) for f in ("q", "scales", "mins")))
                assert torch.equal(seen, kernel_weight(w, dtype).to(dtype).float()), (i, fused)
                assert (kernel_weight(w, dtype) - want).abs().max() <= report.max_abs_diff["bfloat16"]
    assert 0 < report.max_abs_diff["bfloat16"] < 0.01 * report.max_abs_weight


def _stored(out: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    return load_file(str(out / "model.safetensors"))


def test_kept_linear_outputs_equal_the_dequantized_matmul(kept):
    _, out, ref = kept
    model = load_model(out)
    torch.manual_seed(1)
    for i, layer in enumerate(model.layers):
        for fused in PARTS:
            module = layer.get_submodule(fused)
            x = torch.randn(3, 5, module.in_features)                         # [B, T, K]
            want = x.double() @ gguf_weight(ref, i, fused).double().T
            if module.bias is not None:                                        # Qwen2's q/k/v bias
                want = want + module.bias.double()
            err = (module(x).double() - want).abs().max().item()
            assert err <= MATMUL_TOL * want.abs().max().item(), (i, fused, err)


def test_logits_equal_transformers_gguf_load(kept):
    _, out, ref = kept
    with torch.no_grad():
        want = ref(torch.tensor([PROMPT])).logits[0].float()
    got = load_model(out).score(torch.tensor([PROMPT]))[0]
    assert (got - want).abs().max() <= LOGITS_TOL


def test_greedy_speculative_output_equals_plain_output_of_the_kept_target(kept):
    """none vs ngram through the serving build (the folder served as it is, no --quantize); vs
    draft with the kept target as its own draft model (every draft accepted: multi-token verify
    steps) and vs eagle with a random drafter (drafts rejected) on the same kept target."""
    from specserve.core.engine import Engine, EngineConfig
    from specserve.methods.draft.proposer import DraftModelProposer
    from specserve.serving.build import build_engine
    from specserve.serving.settings import DeploymentSettings
    from test_eagle import random_drafter

    _, out, _ = kept
    engine, _ = build_engine(DeploymentSettings(out, max_num_seqs=2, max_model_len=256, drafters=(), device="cpu",
                                                draft_policy="fixed", default_method="none"))
    assert isinstance(engine.model.layers[0].mlp.down_proj, Int4Linear)
    prompt = PROMPT * 3   # repeats: n-gram matches to draft from
    greedy = SamplingParams(max_tokens=24, ignore_eos=True)
    runs = {m: engine.generate([GenerationRequest(m, prompt, greedy, method=m)])[m] for m in ("none", "ngram")}
    assert runs["ngram"].new_token_ids == runs["none"].new_token_ids
    assert runs["ngram"].stats.accepted_tokens > 0

    from specserve.methods.eagle.proposer import EagleProposer

    target = load_model(out)
    limits = dict(max_num_seqs=2, max_model_len=256, max_draft_len=4)
    proposers = {"draft": DraftModelProposer(load_model(out), **limits),
                 "eagle": EagleProposer(random_drafter(target, seed=2, calibration=False), target, threshold=None,
                                        **limits)}
    spec_engine = Engine(target, EngineConfig(**limits), proposers, eos_token_ids=())
    for m in proposers:
        runs[m] = spec_engine.generate([GenerationRequest(m, prompt, greedy, method=m)])[m]
        assert runs[m].new_token_ids == runs["none"].new_token_ids, m
        assert runs[m].stats.draft_tokens > 0, m
    assert runs["draft"].stats.accepted_tokens == runs["draft"].stats.draft_tokens


def test_import_reports_what_it_kept(tmp_path, capsys):
    src = write_tiny_gguf(tmp_path / "llama.gguf", qtype="Q4_1", seed=4)
    out = tmp_path / "imported"
    assert main(["import-gguf", str(src), str(out), "--keep-quantized"]) == 0
    line = capsys.readouterr().out.splitlines()[0]
    report = KeptReport.of_folder(out)
    assert line == (f"specserve: kept 14 projections quantized (14 Q4_1) as int4 group 32; the int4 kernel's "
                    f"weights vs gguf's dequantization: float32 bit-exact, bfloat16 max abs diff "
                    f"{report.max_abs_diff['bfloat16']:.3g} (scales and zeros rounded to bfloat16; largest |w| "
                    f"{report.max_abs_weight:.3g})")
    # Imported again without --keep-quantized: a dense folder, the record gone.
    import_gguf(src, out)
    assert not (out / KEPT_FILE).exists()
    assert isinstance(load_model(out).layers[0].mlp.down_proj, torch.nn.Linear)


def test_projections_that_do_not_map_are_refused_by_name(tmp_path):
    q8 = write_tiny_gguf(tmp_path / "q8.gguf", qtype="Q4_1", tensor_types={"blk.1.attn_v.weight": "Q8_0"})
    with pytest.raises(GGUFImportError) as e:
        import_gguf(q8, tmp_path / "out", keep_quantized=True)
    assert str(e.value) == (
        f"{q8}: blk.1.attn_v.weight is Q8_0, which cannot be kept quantized: its one scale per 32 weights has no "
        f"exact layout in the int8 kernel (one scale per output channel); import without --keep-quantized (exact, "
        f"dequantized) and serve with --quantize int8 to requantize it per channel")
    k = write_tiny_gguf(tmp_path / "k.gguf", qtype="Q4_0", hidden=256, tensor_types={"blk.0.ffn_down.weight": "Q6_K"})
    with pytest.raises(GGUFImportError) as e:
        import_gguf(k, tmp_path / "out", keep_quantized=True)
    assert str(e.value) == (f"{k}: blk.0.ffn_down.weight is Q6_K; --keep-quantized keeps Q4_0 and Q4_1 projections "
                            f"only (the int4 kernel's group-32 layout); import without --keep-quantized to "
                            f"dequantize it")
    assert main(["import-gguf", str(k), str(tmp_path / "out"), "--keep-quantized"]) == 2
    assert not (tmp_path / "out").exists()   # refused before anything was written


def test_quantize_on_a_kept_folder_is_refused(kept):
    from specserve.cli.checks import CliError
    from specserve.cli.main import build_parser, serve_settings

    _, out, _ = kept
    with pytest.raises(QuantizeError) as e:
        served_quantization(Quantization("int8"), Quantization("int4", 32), out)
    message = (f"{out} holds int4 group 32 weights kept from a GGUF file (quantization_config.json): it is served "
               f"as it is, without --quantize int8")
    assert str(e.value) == message
    assert served_quantization(Quantization("none"), Quantization("int4", 32), out) == Quantization("int4", 32)
    args = build_parser().parse_args(["serve", "--target", str(out), "--quantize", "int8", "--device", "cpu"])
    with pytest.raises(CliError) as e:
        serve_settings(args)
    assert str(e.value) == f"--quantize: {message}"


def test_a_kept_folder_is_refused_for_tensor_parallelism(kept):
    """Sharding kept int4 groups is not built: refused before any worker starts, and by load_model."""
    from specserve.model.tensor_parallel import Shard
    from specserve.model.transformer import CheckpointError, load_model
    from specserve.serving.build import build_engine
    from specserve.serving.settings import DeploymentSettings

    _, out, _ = kept
    with pytest.raises(ValueError) as e:
        build_engine(DeploymentSettings(out, device="cpu", tensor_parallel=2, draft_policy="fixed"))
    assert str(e.value) == "tensor_parallel=2 with quantize=int4 group 32 is not supported yet: serve the sharded target unquantized"
    with pytest.raises(CheckpointError) as e:
        load_model(out, shard=Shard(0, 2))
    assert str(e.value) == (f"{out}: kept int4 projections cannot be sharded for tensor parallelism yet; "
                            "import the GGUF without --keep-quantized")
