"""Draft-model proposer: lossless greedy and sampled output, KV rollback, the tokenizer probe, and
the committed demo draft model (models/demo/draft) served by `--drafter draft=DIR` / beside the target."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from conftest import make_tiny_checkpoint
from specserve.core.engine import Engine, EngineConfig, GenerationRequest
from specserve.model.transformer import CheckpointError, load_model
from specserve.methods.draft.drafter import PROBE, TokenizerMismatch, check_tokenizer, load_draft_model
from specserve.methods.draft.proposer import DraftModelProposer
from specserve.core.sampling import SamplingParams
from test_eagle import two_token_joint_tv

ROOT = Path(__file__).resolve().parents[1]
DEMO = ROOT / "models" / "demo"
PROMPTS = [[5, 17, 99, 3, 250, 42, 7, 7, 300, 12], [11, 12, 13, 14, 11, 12, 13], [77], list(range(100, 140))]


def engine_with(target, draft, *, max_num_seqs=4, max_draft_len=5, max_model_len=256):
    prop = DraftModelProposer(draft, max_num_seqs=max_num_seqs, max_model_len=max_model_len,
                              max_draft_len=max_draft_len)
    return Engine(target, EngineConfig(max_num_seqs=max_num_seqs, max_model_len=max_model_len,
                                       max_draft_len=max_draft_len), {"draft": prop}, eos_token_ids=())


def reqs(method, prompts, n=30, **kw):
    return [GenerationRequest(f"{method}{i}", p, SamplingParams(max_tokens=n, **kw), method)
            for i, p in enumerate(prompts)]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    root = tmp_path_factory.mktemp("draft")
    target = load_model(make_tiny_checkpoint(root / "t", "llama", seed=21))
    return target, load_model(make_tiny_checkpoint(root / "d", "llama", seed=22))


def test_greedy_draft_equals_plain_decoding_batched(tiny):
    target, draft = tiny
    engine = engine_with(target, draft)
    plain, spec = engine.generate(reqs("none", PROMPTS)), engine.generate(reqs("draft", PROMPTS))
    for i in range(len(PROMPTS)):
        assert spec[f"draft{i}"].new_token_ids == plain[f"none{i}"].new_token_ids
    assert sum(o.stats.draft_tokens for o in spec.values()) > 0
    prop = engine.proposers["draft"]
    assert prop.cache.num_free == 4 and prop._seqs == {}  # released with their sequences


def test_rollback_keeps_the_draft_cache_exact(tiny):
    """The target as its own draft model: every drafted token must be accepted, which holds only
    if the draft cache is rolled back to exactly the committed tokens after every step (a stale
    entry changes the draft model's logits)."""
    target, _ = tiny
    engine = engine_with(target, target)
    spec = engine.generate(reqs("draft", PROMPTS, n=40))
    for o in spec.values():
        assert o.stats.accepted_tokens == o.stats.draft_tokens > 0
        assert o.stats.drafts >= 7 and o.stats.mean_acceptance_length > 5


def test_drafts_have_max_len_tokens_and_their_distributions(tiny):
    target, draft = tiny
    from specserve.core.proposer import DraftRequest

    prop = DraftModelProposer(draft, max_num_seqs=2, max_model_len=64, max_draft_len=3)
    greedy = SamplingParams(max_tokens=8)
    sampled = SamplingParams(max_tokens=8, temperature=0.7, top_k=20)
    got = prop.propose([DraftRequest(0, [5, 6, 7], 3, greedy), DraftRequest(1, [9, 8], 2, sampled,
                                                                               torch.Generator().manual_seed(0))])
    assert [len(d) for d in got] == [3, 2]
    assert got[0].parents == [-1, 0, 1] and got[0].probs.shape == (3, draft.cfg.vocab_size)
    assert int((got[1].probs[0] > 0).sum()) == 20  # the request's top_k warps q as it warps p
    assert torch.allclose(got[1].probs.sum(-1), torch.ones(2))
    # The cache holds the fed tokens: the three given, then the drafted ones but the last.
    assert prop._seqs[0].tokens == [5, 6, 7] + got[0].tokens[:-1]


def test_a_mixed_batch_drafts_each_row_as_it_drafts_alone(tiny):
    """Greedy and seeded rows are drafted together (one softmax and argmax per position), sampled
    rows one by one from their own generator: batching them changes no row's draft."""
    target, draft = tiny
    from specserve.core.proposer import DraftRequest

    def requests():
        return [DraftRequest(0, [5, 6, 7], 4, SamplingParams(max_tokens=8)),
                DraftRequest(1, [9, 8, 3, 3], 4, SamplingParams(max_tokens=8, temperature=0.9, seed=11), seed=11),
                DraftRequest(2, [4, 2], 3, SamplingParams(max_tokens=8, temperature=0.7, top_k=20),
                             torch.Generator().manual_seed(3)),
                DraftRequest(3, [7, 7, 1], 4, SamplingParams(max_tokens=8))]

    together = DraftModelProposer(draft, max_num_seqs=4, max_model_len=64, max_draft_len=4).propose(requests())
    for r, got in zip(requests(), together):
        alone = DraftModelProposer(draft, max_num_seqs=1, max_model_len=64, max_draft_len=4).propose([r])[0]
        assert got.tokens == alone.tokens and len(got) == r.max_draft_len, r.seq_id
        assert torch.allclose(got.probs, alone.probs, atol=1e-6), r.seq_id
    assert int((together[2].probs > 0).sum(-1).max()) == 20   # the sampled row's q is warped (top-k)
    assert torch.allclose(together[1].probs.sum(-1), torch.ones(4))


def test_sampled_draft_follows_target_distribution(tmp_path):
    """Joint of generated tokens 2 and 3 (drafted and verified in one step) vs the exact target."""
    target = load_model(make_tiny_checkpoint(tmp_path / "t", "llama", vocab_size=8, seed=5))
    draft = load_model(make_tiny_checkpoint(tmp_path / "d", "llama", vocab_size=8, seed=9))
    engine = engine_with(target, draft, max_num_seqs=64, max_draft_len=2)
    tv = two_token_joint_tv(target, engine, "draft")
    assert tv < 0.06, f"total variation {tv:.4f}"


# -- the tokenizer probe --------------------------------------------------------------------------

def test_the_probe_string_has_the_tricky_parts():
    assert "😀" in PROBE and "👨‍👩‍👧" in PROBE                       # emoji, a ZWJ sequence
    assert "<title>" in PROBE and "</doc>" in PROBE                 # XML tags
    assert "\\frac{" in PROBE and "$$" in PROBE                     # LaTeX
    assert "中文" in PROBE and "日本語" in PROBE                      # CJK
    assert "        " in PROBE and "\n\n\n\n" in PROBE and "\t\t" in PROBE  # runs of spaces, newlines, tabs


def _target_tokenizer():
    from tokenizers import Tokenizer
    return Tokenizer.from_file(str(DEMO / "target" / "tokenizer.json"))


def mismatched_tokenizer(tmp_path: Path) -> Path:
    """The target's tokenizer.json without the merge that builds "\\n" + 7 spaces (the indentation
    before `return` in the probe): that run then encodes as shorter tokens."""
    cfg = json.loads((DEMO / "target" / "tokenizer.json").read_text())
    merges = cfg["model"]["merges"]
    joined = lambda m: "".join(m.split(" ") if isinstance(m, str) else m)  # noqa: E731
    cfg["model"]["merges"] = [m for m in merges if joined(m) != "Ċ" + "Ġ" * 7]
    assert len(cfg["model"]["merges"]) < len(merges)
    folder = tmp_path / "mismatched"
    folder.mkdir()
    (folder / "tokenizer.json").write_text(json.dumps(cfg))
    return folder


def test_matching_tokenizers_pass():
    tok = _target_tokenizer()
    check_tokenizer(tok, tok)
    from tokenizers import Tokenizer
    check_tokenizer(tok, Tokenizer.from_file(str(DEMO / "draft" / "tokenizer.json")))


def test_a_mismatched_tokenizer_is_refused_naming_the_first_differing_position(tmp_path):
    from tokenizers import Tokenizer

    bad = Tokenizer.from_file(str(mismatched_tokenizer(tmp_path) / "tokenizer.json"))
    with pytest.raises(TokenizerMismatch) as e:
        check_tokenizer(_target_tokenizer(), bad)
    assert str(e.value) == (
        "the draft model's tokenizer does not produce the target's token ids on the probe string "
        "(217 vs 219 tokens); first difference at token 189: target id 264 '\\n       ', "
        "draft id 260 '\\n    '")


def test_load_draft_model_refuses_a_mismatched_tokenizer(tmp_path):
    import shutil

    folder = mismatched_tokenizer(tmp_path)
    for name in ("config.json", "model.safetensors"):
        shutil.copyfile(DEMO / "draft" / name, folder / name)
    target = load_model(DEMO / "target")
    with pytest.raises(TokenizerMismatch, match=r"first difference at token 189: target id 264 "):
        load_draft_model(folder, target, _target_tokenizer())


def test_load_draft_model_refuses_another_vocabulary(tmp_path):
    target = load_model(make_tiny_checkpoint(tmp_path / "t", "llama", vocab_size=512, seed=1))
    tok = _target_tokenizer()
    with pytest.raises(CheckpointError, match=r"vocab_size 8192 != the target's 512"):
        load_draft_model(DEMO / "draft", target, tok)


# -- the committed demo draft model ---------------------------------------------------------------

def _heldout_ids(n: int) -> list[list[int]]:
    tok = _target_tokenizer()
    lines = (DEMO / "heldout_prompts.jsonl").read_text().splitlines()[:n]
    return [tok.encode(json.loads(x)["prompt"]).ids for x in lines]


def test_demo_draft_model_greedy_equals_none_and_is_accepted():
    target = load_model(DEMO / "target")
    draft = load_draft_model(DEMO / "draft", target, _target_tokenizer())
    prompts = _heldout_ids(3)
    engine = engine_with(target, draft, max_num_seqs=3, max_draft_len=4, max_model_len=256)
    plain, spec = engine.generate(reqs("none", prompts, 32)), engine.generate(reqs("draft", prompts, 32))
    for i in range(len(prompts)):
        assert spec[f"draft{i}"].new_token_ids == plain[f"none{i}"].new_token_ids
    steps = sum(o.stats.steps for o in spec.values())
    accepted = sum(o.stats.accepted_tokens for o in spec.values())
    assert (accepted + steps) / steps > 1.8  # the trained draft model is accepted (card: acceptance length)


def test_drafter_flag_and_discovery_beside_the_target(tmp_path):
    from specserve.cli.checks import CliError, resolve_drafters

    target = DEMO / "target"
    found = dict(resolve_drafters(target, [], False))
    assert Path(found["draft"]).resolve() == (DEMO / "draft").resolve()
    assert resolve_drafters(target, ["draft=models/demo/draft"], False) == (("draft", "models/demo/draft"),)
    from specserve.methods import registry

    assert "draft" in registry.with_drafts("own")
    names = registry.folder_methods()   # --drafter mtp=DIR names mtp's MTP heads
    with pytest.raises(CliError) as e:
        resolve_drafters(target, ["dragt=models/demo/draft"], False)
    assert str(e.value) == f"--drafter: unknown method 'dragt'; drafters: {', '.join(names)}"


def test_factory_builds_the_draft_method(tmp_path):
    from specserve.serving.build import build_engine
    from specserve.serving.settings import DeploymentSettings

    settings = DeploymentSettings(DEMO / "target", max_num_seqs=2, max_model_len=128, max_draft_len=4,
                                  drafters=(("draft", str(DEMO / "draft")),), drafter_dtype="float32",
                                  draft_policy="fixed", default_method="none")
    engine, _ = build_engine(settings)
    prop = engine.proposers["draft"]
    assert isinstance(prop, DraftModelProposer) and prop.name == "draft" and not prop.needs_features
    assert prop.draft.cfg.num_layers < engine.model.cfg.num_layers
