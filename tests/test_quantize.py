"""Weight-only quantized targets (--quantize int8|int4): the quantized linear equals a matmul with
its dequantized weight; quantize_target replaces the decoder projections and nothing else; bad
modes and group sizes are refused with exact messages; and speculation stays lossless relative
to the quantized target — greedy output of every method equals the same target's plain greedy
output, and sampled output follows its distribution."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from torch import nn

from conftest import make_tiny_checkpoint
from specserve.core.engine import GenerationRequest
from specserve.core.sampling import SamplingParams
from specserve.methods import registry
from specserve.model.dense_linear import OneDNNLinear, onednn_available
from specserve.model.quantize import (INT4_GROUP_SIZES, Quantization, QuantizeError, check_quantization,
                                      quantize_target)
from specserve.model.quantized_linear import Int4Linear, Int8Linear, int4_weights, int8_weights
from specserve.model.transformer import load_config, load_model

ROOT = Path(__file__).resolve().parents[1]
DEMO = ROOT / "models" / "demo"
DRAFTERS = tuple((m, str(DEMO / m)) for m in registry.folder_methods())
METHODS = [m for m in registry.names() if m != "none"]
PROMPT = "def parse_args(argv):\n    parser = argparse."   # code: the demo drafters' domain
MAX_TOKENS = 16
# The kernels accumulate in fp32 in their own order; against an fp64 matmul with the dequantized
# weight that is rounding only: 1e-5 of the output's scale (fp32). bf16 activations round the
# inputs, scales and output to 8 bits of mantissa: 2 % of the output's scale.
TOLERANCE = {torch.float32: 1e-5, torch.bfloat16: 2e-2}


def dense(out_features: int, in_features: int, bias: bool, dtype: torch.dtype, seed: int = 0) -> nn.Linear:
    torch.manual_seed(seed)
    linear = nn.Linear(in_features, out_features, bias=bias)
    with torch.no_grad():
        linear.weight.normal_(0, 0.15)
    return linear.to(dtype)


def dequantized_int8(weight: torch.Tensor) -> torch.Tensor:
    q, scales = int8_weights(weight)
    return q.double() * scales.double()[:, None]                       # [N, K]


def dequantized_int4(weight: torch.Tensor, group_size: int) -> torch.Tensor:
    q, sz = int4_weights(weight, group_size)                           # [N, K], [K/G, N, 2]
    scales = sz[..., 0].T.double().repeat_interleave(group_size, dim=1)   # [N, K]
    zeros = sz[..., 1].T.double().repeat_interleave(group_size, dim=1)
    return (q.double() - 8) * scales + zeros


def assert_close_to_reference(module: nn.Module, reference_weight: torch.Tensor, bias, dtype) -> None:
    torch.manual_seed(1)
    x = torch.randn(3, 5, module.in_features).to(dtype)                # [B, T, K]: any leading dims
    want = x.double() @ reference_weight.T + (0 if bias is None else bias.double())
    got = module(x)
    assert got.shape == (3, 5, module.out_features) and got.dtype == dtype
    err = (got.double() - want).abs().max().item()
    assert err <= TOLERANCE[dtype] * want.abs().max().item(), err


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("bias", [False, True])
def test_int8_linear_equals_its_dequantized_matmul(dtype, bias):
    linear = dense(96, 128, bias, dtype)
    ref = dequantized_int8(linear.weight)
    # Round to nearest: each weight within half a step of its channel's grid.
    step = linear.weight.float().abs().amax(dim=1, keepdim=True) / 127
    assert ((ref - linear.weight.double()).abs() <= step.double() / 2 + 1e-7).all()
    module = Int8Linear(linear)
    # The kernel reads its scales in the activation dtype.
    ref_in_dtype = int8_weights(linear.weight)[0].double() * module.scales.double()[:, None]
    assert_close_to_reference(module, ref_in_dtype, linear.bias, dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("group_size", INT4_GROUP_SIZES)
def test_int4_linear_equals_its_dequantized_matmul(dtype, group_size):
    linear = dense(96, 256, True, dtype)
    ref = dequantized_int4(linear.weight, group_size)
    groups = linear.weight.float().reshape(96, -1, group_size)
    step = ((groups.amax(-1) - groups.amin(-1)) / 15).repeat_interleave(group_size, dim=1)  # [N, K]
    assert ((ref - linear.weight.double()).abs() <= step.double() / 2 + 1e-6).all()
    module = Int4Linear.from_linear(linear, group_size)
    # The kernel reads its scales and zeros in the activation dtype.
    sz = module.scales_and_zeros.double()
    ref_in_dtype = (int4_weights(linear.weight, group_size)[0].double() - 8) * \
        sz[..., 0].T.repeat_interleave(group_size, 1) + sz[..., 1].T.repeat_interleave(group_size, 1)
    assert_close_to_reference(module, ref_in_dtype, linear.bias, dtype)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> Path:
    """A tiny tied Qwen2 (q/k/v biases): hidden 64, intermediate 128."""
    return Path(make_tiny_checkpoint(tmp_path_factory.mktemp("q") / "qwen2", "qwen2", tie=True, seed=3))


@pytest.mark.parametrize("mode", ["int8", "int4"])
def test_quantize_target_replaces_the_decoder_projections_only(tiny, mode):
    model = quantize_target(load_model(tiny), Quantization(mode, 32))
    kind = Int8Linear if mode == "int8" else Int4Linear
    for layer in model.layers:
        for m in (layer.self_attn.qkv_proj, layer.self_attn.o_proj, layer.mlp.gate_up_proj, layer.mlp.down_proj):
            assert isinstance(m, kind)
        assert layer.self_attn.qkv_proj.bias is not None   # Qwen2's q/k/v bias kept
    assert not any(isinstance(m, nn.Linear) for layer in model.layers for m in layer.modules())
    # The embedding and the (tied) LM head stay dense, in the model's dtype, still one tensor.
    assert isinstance(model.lm_head, nn.Linear) and model.lm_head.weight is model.embed_tokens.weight
    assert model.dtype == torch.float32
    tokens = torch.tensor([[1, 5, 9, 4]])
    assert model.score(tokens).shape == (1, 4, model.cfg.vocab_size)


def test_an_int8_head_gives_the_logits_and_keeps_the_dense_weight(tiny):
    """--quantize-head int8: the target's logits are the int8 copy's; `.weight` is still the
    (tied) embedding the drafters read; the projections are left to --quantize."""
    from specserve.cli.bench.bandwidth import weight_bytes
    from specserve.model.quantized_linear import Int8Head

    dense = load_model(tiny)
    model = quantize_target(load_model(tiny), Quantization("none", 32, "int8"))
    assert isinstance(model.lm_head, Int8Head) and model.lm_head.weight is model.embed_tokens.weight
    assert isinstance(model.layers[0].mlp.down_proj, nn.Linear)
    h = torch.randn(3, model.cfg.hidden_size)
    expect = torch.ops.aten._weight_int8pack_mm(h, *int8_weights(dense.lm_head.weight))
    assert torch.equal(model.lm_head(h), expect)
    V, D = model.cfg.vocab_size, model.cfg.hidden_size
    # the step reads the int8 copy (V·D bytes) and its fp32 scales instead of the dense V·D·4
    assert weight_bytes(dense) - weight_bytes(model) == V * D * 4 - (V * D + V * 4)
    assert Quantization("int4", 32, "int8").label() == "int4 group 32 + int8 head"
    assert Quantization("none", 32, "int8").label() == "int8 head" and Quantization().label() == "none"


def test_quantize_none_leaves_the_model_alone(tiny):
    model = load_model(tiny)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    quantize_target(model, Quantization("none"))
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())


def test_bad_quantization_is_refused_with_a_clear_message(tiny):
    cfg = load_config(tiny)   # hidden 64, intermediate 128
    cases = {
        Quantization("int3"): "quantize must be one of none, int8, int4, got 'int3'",
        Quantization("int8", 32, "int4"): "quantize head must be one of none, int8, got 'int4'",
        Quantization("int4", 16): "int4 group size must be one of 32, 64, 128, 256 (the int4 kernels' sizes), got 16",
        Quantization("int4", 128): "int4 group size 128 does not divide self_attn.qkv_proj's 64 input features; "
                                   "sizes that divide every layer's: 32, 64",
    }
    for q, message in cases.items():
        with pytest.raises(QuantizeError) as e:
            check_quantization(q, cfg, "cpu", "float32")
        assert str(e.value) == message
    with pytest.raises(QuantizeError) as e:
        check_quantization(Quantization("int4", 32), cfg, "cuda", "float32")
    assert str(e.value) == "int4 on CUDA needs --dtype bfloat16 (its kernel takes bf16 activations only), got float32"
    check_quantization(Quantization("int4", 32), cfg, "cuda", "bfloat16")
    check_quantization(Quantization("int8", 16), cfg, "cuda", "float32")   # int8 has no groups
    with pytest.raises(QuantizeError, match="^quantize must be one of"):
        quantize_target(load_model(tiny), Quantization("int3"))


def test_serve_refuses_a_bad_group_size_before_starting(tmp_path, capsys):
    from specserve.cli.checks import CliError
    from specserve.cli.main import build_parser, serve_settings
    from specserve.model.tiny import make_tiny_llama

    tiny = make_tiny_llama(tmp_path / "tiny")   # with a tokenizer: hidden 64, intermediate 128
    parser = build_parser()
    args = parser.parse_args(["serve", "--target", str(tiny), "--quantize", "int4", "--quantize-group-size", "128",
                              "--device", "cpu"])
    with pytest.raises(CliError) as e:
        serve_settings(args)
    assert str(e.value) == ("--quantize-group-size: int4 group size 128 does not divide self_attn.qkv_proj's 64 "
                            "input features; sizes that divide every layer's: 32, 64")
    with pytest.raises(SystemExit):
        parser.parse_args(["serve", "--target", str(tiny), "--quantize", "int3"])
    assert "argument --quantize: invalid choice: 'int3'" in capsys.readouterr().err
    ok = parser.parse_args(["serve", "--target", str(tiny), "--quantize", "int4", "--quantize-group-size", "64",
                            "--device", "cpu", "--no-drafters"])
    settings, _ = serve_settings(ok)
    assert settings.quantization() == Quantization("int4", 64)


# -- lossless relative to the quantized target: the demo deployment, every method ------------

# (quantize, head, dtype, attention). fp32 activations: the quantized kernels compute each row
# alone, and fp32 SDPA's rounding by call shape stayed below every near-tie measured. bf16 with
# per-query attention: every verify row is its decode step's bits (model/invariant_attention.py).
QUANTIZED_DEMOS = [("int8", "none", "float32", "batched"), ("int4", "none", "float32", "batched"),
                   ("int4", "int8", "float32", "batched"), ("int4", "int8", "bfloat16", "per-query"),
                   ("int8", "int8", "bfloat16", "per-query"), ("none", "none", "bfloat16", "per-query")]


def demo_id(demo: tuple[str, str, str, str]) -> str:
    """e.g. int4+head8/bf16/per-query: the weights, then what differs from fp32 batched."""
    quantize, head, dtype, attention = demo
    weights = [quantize] if quantize != "none" else []
    weights += [f"head{head.removeprefix('int')}"] if head != "none" else []
    parts = ["+".join(weights)] + (["bf16"] if dtype == "bfloat16" else [])
    parts += [attention] if attention != "batched" else []
    return "/".join(p for p in parts if p)


@pytest.fixture(scope="module", params=QUANTIZED_DEMOS, ids=demo_id)
def quantized_demo(request):
    """The demo deployment with a quantized target (in some an int8 LM head, bf16 activations and
    per-query attention), every method fused. Skipped, with the reason, where this CPU's kernels
    round rows by call width (build refuses per-query attention there)."""
    from specserve.serving.build import build_engine
    from specserve.serving.settings import DeploymentSettings

    quantize, head, dtype, attention = request.param
    settings = DeploymentSettings(DEMO / "target", max_num_seqs=len(METHODS), max_model_len=256, drafters=DRAFTERS,
                                  device="cpu", draft_policy="fixed", default_method="none", quantize=quantize,
                                  quantize_head=head, dtype=dtype, attention=attention)
    try:
        engine, tok = build_engine(settings)
    except ValueError as e:
        if attention != "per-query" or "rounds a row differently" not in str(e):
            raise
        pytest.skip(f"this CPU: {e}")
    greedy = SamplingParams(max_tokens=MAX_TOKENS, ignore_eos=True)
    ids = tok.encode(PROMPT).ids
    plain = engine.generate([GenerationRequest("none", ids, greedy, method="none")])["none"].new_token_ids
    return engine, ids, plain


def test_the_demo_target_is_quantized(quantized_demo, request):
    engine, _, _ = quantized_demo
    quantize, _, dtype, attention = request.node.callspec.params["quantized_demo"]
    # A projection left dense runs on oneDNN where auto picks it (fp32 on a CPU: dense_linear.py)
    dense_kind = OneDNNLinear if dtype == "float32" and onednn_available() else nn.Linear
    kinds = {"int8": Int8Linear, "int4": Int4Linear, "none": dense_kind}
    assert type(engine.model.layers[0].mlp.down_proj) is kinds[quantize]
    assert engine.model.dtype == getattr(torch, dtype)
    assert engine.model.per_query_attention == (attention == "per-query")


def test_greedy_speculative_output_equals_plain_output_of_the_quantized_target(quantized_demo):
    """Every method in one batch (each method's verify beside the others'), on the code prompt
    the demo drafters know: the quantized target's plain tokens, with drafted tokens accepted
    (so the drafts mattered)."""
    engine, ids, plain = quantized_demo
    greedy = SamplingParams(max_tokens=MAX_TOKENS, ignore_eos=True)
    out = engine.generate([GenerationRequest(m, ids, greedy, method=m) for m in METHODS])
    for m in METHODS:
        assert out[m].new_token_ids == plain and out[m].stats.method == m, m
        assert out[m].stats.accepted_tokens > 0, f"{m} never had a drafted token accepted"


def test_sampled_eagle_follows_the_quantized_target_distribution(tmp_path):
    """The TV test of test_eagle.py with an int4 target: the joint of generated tokens 2 and 3
    (drafted and verified in one step) against the exact joint of the same int4 target."""
    from test_eagle import engine_with, random_drafter, two_token_joint_tv

    target = load_model(make_tiny_checkpoint(tmp_path / "small", "llama", vocab_size=8, seed=5))
    quantize_target(target, Quantization("int4", 32))
    engine = engine_with(target, random_drafter(target, seed=2, calibration=False), threshold=None,
                         max_num_seqs=64, max_draft_len=2)
    tv = two_token_joint_tv(target, engine, "eagle")
    assert tv < 0.06, f"total variation {tv:.4f}"
