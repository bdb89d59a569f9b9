"""The target's dense linear kernel (--linear-kernel, model/dense_linear.py): oneDNN's linear
equals nn.Linear's to fp32 rounding, shares its parameters (a tied embedding stays tied), swaps
only plain nn.Linear layers, is chosen by `auto` exactly where it can run, and is refused with an
exact message where it cannot; served greedy output of every method still equals plain output."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from conftest import make_tiny_checkpoint
from specserve.core.engine import GenerationRequest
from specserve.core.sampling import SamplingParams
from specserve.methods import registry
from specserve.model.dense_linear import OneDNNLinear, onednn_available, resolve_linear_kernel, use_onednn_linears
from specserve.model.quantize import Quantization, quantize_target
from specserve.model.quantized_linear import Int8Linear
from specserve.model.transformer import load_model

ROOT = Path(__file__).resolve().parents[1]
DEMO = ROOT / "models" / "demo"
needs_onednn = pytest.mark.skipif(not onednn_available(), reason="this PyTorch build has no oneDNN")


@needs_onednn
@pytest.mark.parametrize("shape,bias", [((1, 48), False), ((3, 48), True), ((2, 5, 48), True)])
def test_onednn_linear_equals_nn_linear_and_shares_its_parameters(shape, bias):
    torch.manual_seed(0)
    linear = nn.Linear(48, 80, bias=bias)
    x = torch.randn(*shape)
    fast = OneDNNLinear.of(linear)
    assert fast.weight is linear.weight and fast.bias is linear.bias
    got, want = fast(x), F.linear(x, linear.weight, linear.bias)
    assert got.shape == want.shape == (*shape[:-1], 80)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    # a control: a different weight is not within that tolerance
    assert not torch.allclose(got, F.linear(x, linear.weight * 1.001, linear.bias), rtol=1e-5, atol=1e-5)


@needs_onednn
def test_swap_keeps_tied_embeddings_and_quantized_layers(tmp_path):
    model = load_model(make_tiny_checkpoint(tmp_path / "tied", "llama", tie=True))
    quantize_target(model, Quantization("int8", 32))
    ids = torch.tensor([[5, 17, 33, 2]])
    before = model.score(ids)
    swapped = use_onednn_linears(model)
    # 2 layers quantized (4 projections each, all Int8Linear): the LM head is the one dense linear
    assert swapped == 1
    assert type(model.lm_head) is OneDNNLinear and model.lm_head.weight is model.embed_tokens.weight
    assert all(type(m) is Int8Linear for m in model.layers[0].mlp.modules() if isinstance(m, (nn.Linear, Int8Linear)))
    torch.testing.assert_close(model.score(ids), before, rtol=1e-5, atol=1e-5)
    assert use_onednn_linears(model) == 0   # nothing plain is left to swap


@pytest.mark.parametrize("kernel,device,dtype,tp,want", [
    ("auto", "cpu", "float32", 1, "onednn"),
    ("auto", "cpu", "bfloat16", 1, "aten"),     # bf16 linears already run on oneDNN
    ("auto", "cuda", "float32", 1, "aten"),
    ("auto", "cpu", "float32", 2, "aten"),
    ("aten", "cpu", "float32", 1, "aten"),
    ("onednn", "cpu", "bfloat16", 1, "onednn"),
])
def test_auto_picks_onednn_for_a_float32_cpu_target_in_one_process(kernel, device, dtype, tp, want):
    if want == "onednn" and not onednn_available():
        want = "aten" if kernel == "auto" else pytest.skip("this PyTorch build has no oneDNN")
    assert resolve_linear_kernel(kernel, device, dtype, tp) == want


@pytest.mark.parametrize("device,tp,message", [
    ("cuda", 1, "--linear-kernel onednn: it runs on a CPU only; use --linear-kernel aten"),
    ("cpu", 2, "--linear-kernel onednn: tensor-parallel workers build their own shards with nn.Linear; "
               "use --linear-kernel aten"),
])
def test_onednn_where_it_cannot_run_is_refused(device, tp, message):
    with pytest.raises(ValueError) as e:
        resolve_linear_kernel("onednn", device, "float32", tp)
    assert str(e.value) == message
    with pytest.raises(ValueError, match=r"^linear kernel must be one of auto, aten, onednn, got 'mkl'$"):
        resolve_linear_kernel("mkl", "cpu", "float32")


@needs_onednn
def test_served_greedy_output_of_every_method_equals_plain_with_either_kernel():
    """The demo deployment, every method fused, built with each kernel: the target's projections
    are the kernel's modules, every method's greedy tokens equal its own plain tokens (with
    drafts accepted), and the two kernels' plain tokens are the same on this prompt."""
    from specserve.serving.build import build_engine
    from specserve.serving.settings import DeploymentSettings

    methods = [m for m in registry.names() if m != "none"]
    drafters = tuple((m, str(DEMO / m)) for m in registry.folder_methods())
    greedy = SamplingParams(max_tokens=16, ignore_eos=True)
    plain = {}
    for kernel, kind in (("aten", nn.Linear), ("auto", OneDNNLinear)):
        settings = DeploymentSettings(DEMO / "target", max_num_seqs=len(methods), max_model_len=256, drafters=drafters,
                                      device="cpu", draft_policy="fixed", default_method="none", linear_kernel=kernel)
        engine, tok = build_engine(settings)
        assert type(engine.model.layers[0].self_attn.qkv_proj) is kind and type(engine.model.lm_head) is kind
        ids = tok.encode("def parse_args(argv):\n    parser = argparse.").ids
        plain[kernel] = engine.generate([GenerationRequest("none", ids, greedy, method="none")])["none"].new_token_ids
        out = engine.generate([GenerationRequest(m, ids, greedy, method=m) for m in methods])
        for m in methods:
            assert out[m].new_token_ids == plain[kernel], (kernel, m)
            assert out[m].stats.accepted_tokens > 0, (kernel, m)
    assert plain["auto"] == plain["aten"]
