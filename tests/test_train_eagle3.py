"""training/train_eagle3.py: the unrolled training forward is what drafting computes, and the
script runs end to end on a tiny target, is deterministic, resumes exactly and writes the public
EAGLE-3 layout with its draft vocabulary."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch

from conftest import make_served_checkpoint, make_tiny_checkpoint
from specserve.core.forward import ForwardBatch
from specserve.core.masks import build_mask, chain_parents
from specserve.model.tiny import CORPUS, train_tiny_tokenizer
from specserve.model.transformer import load_model
from specserve.methods.eagle.drafter import load_eagle
from specserve.methods.eagle.eagle3 import Eagle3Drafter, draft_vocab

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "training"))
import distill_corpus  # noqa: E402
import train_eagle3  # noqa: E402
from distill_shards import gzip_lines  # noqa: E402


def test_the_unrolled_steps_see_what_drafting_k_tokens_ahead_sees(tmp_path):
    """Step k of training-time test at pair i equals the drafter run as the proposer runs it:
    the true pairs 0..i in its cache, then k speculative pairs of its own hidden states (with the
    window's next tokens), each at the next position."""
    target = load_model(make_tiny_checkpoint(tmp_path / "t", "llama", seed=3, num_hidden_layers=4))
    torch.manual_seed(0)
    cfg = target.cfg.__class__(**{**target.cfg.__dict__, "num_layers": 1})
    d = Eagle3Drafter(cfg, (0, 1, 3), 64)
    d.set_vocab(*draft_vocab(torch.arange(cfg.vocab_size), 64))
    with torch.no_grad():
        for p in d.parameters():
            if p.dim() == 2:
                p.normal_(0, 0.1)
    tokens = torch.randint(0, cfg.vocab_size, (1, 12))
    K, n = 3, 12 - 1 - 2
    with torch.no_grad():
        out = target.forward(train_eagle3.e1.causal_batch(tokens), None, hidden_layers=(0, 1, 3))
        feats = torch.cat([out.hidden] + [out.layer_hidden[i] for i in (0, 1, 3)], -1)
        emb = target.embed_tokens(tokens)
        kv, h, unrolled = train_eagle3._UnrollKV(), d.fuse(feats[:, :n]), []
        zero = torch.zeros(1, dtype=torch.long)
        for k in range(K):
            b = ForwardBatch(tokens[:, 1 + k:1 + k + n], (torch.arange(n) + k)[None], zero, zero,
                             train_eagle3.unroll_mask(1, n, k))
            h = d(h, emb[:, 1 + k:1 + k + n], b, kv)
            unrolled.append(h)
        for i in (0, 4, n - 1):
            cache = d.new_cache(1, 64)
            slot = cache.allocate()
            m, p = build_mask([0], [chain_parents(i + 1)], i + 1)
            hh = d(d.fuse(feats[:, :i + 1]), emb[:, 1:i + 2],
                   ForwardBatch(tokens[:, 1:i + 2], p, torch.tensor([slot]), zero, m), cache)[:, -1:]
            torch.testing.assert_close(hh, unrolled[0][:, i:i + 1], rtol=1e-5, atol=1e-6)
            for k in range(1, K):
                start = i + k   # the speculative pair's index and position
                m, p = build_mask([start], [[-1]], 1)
                hh = d(hh, emb[:, i + k + 1:i + k + 2],
                       ForwardBatch(tokens[:, i + k + 1:i + k + 2], p, torch.tensor([slot]), torch.tensor([start]), m),
                       cache)
                torch.testing.assert_close(hh, unrolled[k][:, i:i + 1], rtol=1e-5, atol=1e-6, msg=f"i={i} k={k}")


def run(target, text, out, work, steps, *extra):
    train_eagle3.main(["--target", str(target), "--out", str(out), "--text-file", str(text),
                       "--heldout-file", str(text), "--work-dir", str(work), "--steps", str(steps),
                       "--seq-len", "32", "--batch", "2", "--self-prompts", "2", "--self-new-tokens", "8",
                       "--calib-prompts", "4", "--calib-new-tokens", "8", "--calib-epochs", "2",
                       "--calib-serving-prompts", "4", "--calib-prompts-file", str(text), "--ckpt-every", "3",
                       "--draft-vocab", "96", "--ttt-steps", "3", "--target-layers", "1", "2", "4", *extra])


def test_train_eagle3_is_deterministic_resumes_and_saves_its_vocabulary(tmp_path):
    target = Path(make_tiny_checkpoint(tmp_path / "target", "llama", vocab_size=400, seed=3, num_hidden_layers=4))
    train_tiny_tokenizer(target, 400)
    text = tmp_path / "text.txt"
    text.write_text(("\n".join(CORPUS) + "\n") * 20)

    run(target, text, tmp_path / "straight", tmp_path / "w1", 6)
    run(target, text, tmp_path / "resumed", tmp_path / "w2", 6, "--stop-at", "3")
    assert not (tmp_path / "resumed").exists()   # interrupted runs write no drafter
    run(target, text, tmp_path / "resumed", tmp_path / "w2", 6)   # resumes at step 3

    model = load_model(target)
    a, b = load_eagle(tmp_path / "straight", model), load_eagle(tmp_path / "resumed", model)
    assert isinstance(a, Eagle3Drafter) and a.feature_layers == (0, 1, 3) and a.draft_vocab_size == 96
    sa, sb = a.state_dict(), b.state_dict()
    assert sa.keys() == sb.keys() and any(k.startswith("calibration.") for k in sa)
    for k in sa:
        torch.testing.assert_close(sa[k], sb[k], rtol=0, atol=1e-6, msg=k)
    # The draft vocabulary is the data's 96 most frequent tokens (the saved one is the work dir's).
    vocab = torch.load(tmp_path / "w1" / "draft_vocab.pt", weights_only=True)
    assert torch.equal(a.d2t, vocab["d2t"]) and torch.equal(a.t2d, vocab["t2d"])
    raw = json.loads((tmp_path / "straight" / "config.json").read_text())
    assert raw["draft_vocab_size"] == 96 and raw["eagle_aux_hidden_state_layer_ids"] == [1, 2, 4]
    summary = json.loads((tmp_path / "straight" / "training.json").read_text())
    assert summary["ttt_steps"] == 3 and len(summary["final_teacher_forced_top1_per_step"]) == 3
    assert 0 < summary["draft_vocab_coverage"] <= 1 and summary["calibration"]["heldout"]["examples"] > 0
    log = [json.loads(r) for r in (tmp_path / "straight" / "train_log.jsonl").read_text().splitlines()]
    assert [r["step"] for r in log] == list(range(1, 7)) and all(len(r["top1"]) == 3 for r in log)


def test_distill_shards_are_read_as_prompt_plus_response(tmp_path):
    shards = tmp_path / "d" / "shards"
    shards.mkdir(parents=True)

    def item(i, prompt, response):
        return json.dumps({"id": f"i{i}", "phase": "response", "source": "man", "messages": [
            {"role": "user", "content": f"question {i}"}], "sampling": {"temperature": 0.0},
            "prompt_ids": prompt, "response_ids": response})

    (shards / "shard-00000.jsonl.gz").write_bytes(gzip_lines([item(0, [1, 2], [3]), item(1, [4], [5, 6])]))
    (shards / "shard-00001.tmp").write_text("partial")   # a generator mid-write: left alone
    assert train_eagle3.distill_sequences(tmp_path / "d") == [[1, 2, 3], [4, 5, 6]]
    assert (shards / "shard-00001.tmp").exists()


def test_a_run_keeps_the_items_it_started_on_while_the_folder_grows(tmp_path):
    """The items are fixed at the first start (train split, recorded in the work dir); a folder
    that grew since is refused with the --max-items that resumes on the same items."""
    shards = tmp_path / "d" / "shards"
    shards.mkdir(parents=True)

    def item(i):
        return json.dumps({"id": f"i{i}", "phase": "response", "source": "man", "messages": [
            {"role": "user", "content": f"question {i}"}], "sampling": {"temperature": 0.0},
            "prompt_ids": [i, i + 1], "response_ids": [i + 2]})

    (shards / "shard-00000.jsonl.gz").write_bytes(gzip_lines([item(i) for i in range(40)]))
    work = tmp_path / "w"
    work.mkdir()
    first, held = train_eagle3.run_items([tmp_path / "d"], work, validation_share=0.25, max_items=None)
    left_out = [f"i{i}" for i in range(40) if distill_corpus.is_validation(f"i{i}", 0.25)]
    assert 0 < len(left_out) < 20 and [s.id for s in first] == [f"i{i}" for i in range(40) if f"i{i}" not in left_out]
    assert [s.id for s in held] == left_out
    (shards / "shard-00001.jsonl.gz").write_bytes(gzip_lines([item(i) for i in range(40, 50)]))   # the generator goes on
    with pytest.raises(SystemExit, match=rf"holds a run on {len(first)} training items of its first 40 finished "
                                         rf"ones \(validation share 0.25\); .* now give \d+ of 50. Resume with "
                                         rf"--max-items 40 --validation-share 0.25"):
        train_eagle3.run_items([tmp_path / "d"], work, validation_share=0.25, max_items=None)
    again, _ = train_eagle3.run_items([tmp_path / "d"], work, validation_share=0.25, max_items=40)
    assert again == first


def test_distill_windows_end_at_an_item_and_mask_all_but_its_response():
    """Each window is the last T tokens of the stream up to an item's end; the mask marks the
    positions whose next token is a response token. Drawn by response tokens, seeded."""
    from distill_corpus import DistillSequence

    items = [DistillSequence("a", "man", False, [1, 2, 3, 4, 5], 3),
             DistillSequence("b", "man", False, [6, 7, 8, 9], 1),
             DistillSequence("c", "man", True, [10, 11, 12], 2)]
    want = {(2, 3, 4, 5): (0, 1, 1, 0), (6, 7, 8, 9): (1, 1, 1, 0), (9, 10, 11, 12): (0, 0, 1, 0)}
    data = train_eagle3.distill_windows(items, seq_len=4, batch=3, seed=5)
    seen = []
    for _ in range(60):
        tokens, mask = next(data)
        assert tokens.shape == mask.shape == (3, 4)
        for row, m in zip(tokens.tolist(), mask.tolist()):
            assert want[tuple(row)] == tuple(int(x) for x in m)
            seen.append(tuple(row))
    n = {w: seen.count(w) for w in want}
    assert n[(6, 7, 8, 9)] > n[(2, 3, 4, 5)] > n[(9, 10, 11, 12)] > 0   # weights 3 : 2 : 1
    again = train_eagle3.distill_windows(items, seq_len=4, batch=3, seed=5)
    assert all(torch.equal(next(again)[0], torch.tensor(seen[3 * i:3 * i + 3])) for i in range(60))


def seeded_drafter(cfg, target) -> Eagle3Drafter:
    """The drafter the step tests train: seed 0, a 64-token vocabulary, started from the target."""
    torch.manual_seed(0)
    d = Eagle3Drafter(cfg, (0, 1, 3), 64)
    d.set_vocab(*draft_vocab(torch.arange(cfg.vocab_size), 64))
    train_eagle3.init_from_target(d, target)
    return d


def test_the_loss_mask_leaves_positions_out_of_the_step(tmp_path):
    """A mask of ones is the unmasked step; a mask of zeros learns nothing (zero loss, no update)."""
    target = load_model(make_tiny_checkpoint(tmp_path / "t", "llama", seed=3, num_hidden_layers=4))
    cfg = target.cfg.__class__(**{**target.cfg.__dict__, "num_layers": 1})
    tokens = torch.randint(0, cfg.vocab_size, (2, 16), generator=torch.Generator().manual_seed(1))

    def step(mask):
        d = seeded_drafter(cfg, target)
        before = [p.detach().clone() for p in d.parameters()]
        opt = torch.optim.SGD(d.parameters(), lr=0.1)
        losses = train_eagle3.train_step(d, target, tokens, opt, ttt_steps=3, loss_mask=mask)
        return losses, any(not torch.equal(a, b) for a, b in zip(before, d.parameters()))

    plain, moved = step(None)
    ones, moved_ones = step(torch.ones(2, 16))
    zeros, moved_zeros = step(torch.zeros(2, 16))
    assert plain.ce > 0 and moved and moved_ones
    assert ones.ce == plain.ce and ones.top1 == plain.top1
    assert zeros.ce == 0 and zeros.top1 == [0.0, 0.0, 0.0] and not moved_zeros


def test_a_bf16_step_follows_the_fp32_step_and_keeps_fp32_weights(tmp_path):
    """--bf16 runs the window's forwards under bf16 autocast: the loss stays within 2 % of fp32's
    (not equal: bf16 rounds), every parameter moves the way the fp32 step moves it (on this tiny
    random target, near-uniform distributions leave a small gradient beside bf16's rounding, so
    the directions agree loosely; SmolLM2's losses agreed to 0.1 % over three steps), and the
    weights stay fp32. Without the flag the step is fp32's, exactly."""
    target = load_model(make_tiny_checkpoint(tmp_path / "t", "llama", seed=3, num_hidden_layers=4))
    cfg = target.cfg.__class__(**{**target.cfg.__dict__, "num_layers": 1})
    tokens = torch.randint(0, cfg.vocab_size, (2, 16), generator=torch.Generator().manual_seed(1))

    def step(bf16):
        d = seeded_drafter(cfg, target)
        before = {n: p.detach().clone() for n, p in d.named_parameters()}
        opt = torch.optim.SGD(d.parameters(), lr=0.1)
        losses = train_eagle3.train_step(d, target, tokens, opt, ttt_steps=3, bf16=bf16)
        return losses, d, {n: (p.detach() - before[n]).flatten() for n, p in d.named_parameters()}

    (l32, _, u32), (l32b, _, u32b), (l16, d16, u16) = step(False), step(False), step(True)
    assert l32 == l32b and all(torch.equal(u32[n], u32b[n]) for n in u32)
    assert l16.ce == pytest.approx(l32.ce, rel=0.02) and l16.ce != l32.ce
    assert {p.dtype for p in d16.parameters()} == {torch.float32}
    moved = {n: a for n, a in u32.items() if not n.startswith("calibration.")}   # not in the backbone loss
    assert moved and all(float(a.norm()) > 0 for a in moved.values())
    for name, a in moved.items():
        assert float(torch.nn.functional.cosine_similarity(a, u16[name], dim=0)) > 0.5, name
        assert float(u16[name].norm()) == pytest.approx(float(a.norm()), rel=0.2), name


def test_distill_prompts_are_the_items_prompts_seeded(tmp_path):
    """The calibration head of a chat drafter is fit on the distill folder's own prompts (what the
    server will see), never their responses: the ids before response_start, a seeded sample."""
    shards = tmp_path / "d" / "shards"
    shards.mkdir(parents=True)
    rows = [json.dumps({"id": f"i{i}", "phase": "response", "source": "man", "messages": [
        {"role": "user", "content": f"question {i}"}], "sampling": {"temperature": 0.0},
        "prompt_ids": [10 * i, 10 * i + 1], "response_ids": [10 * i + 2]}) for i in range(5)]
    (shards / "shard-00000.jsonl.gz").write_bytes(gzip_lines(rows))
    got = train_eagle3.distill_prompts(tmp_path / "d", 3, seed=7)
    assert len(got) == 3 and got == train_eagle3.distill_prompts(tmp_path / "d", 3, seed=7)
    assert all(p in [[10 * i, 10 * i + 1] for i in range(5)] for p in got)
    assert sorted(map(tuple, train_eagle3.distill_prompts(tmp_path / "d", 9, seed=0))) == \
        [(10 * i, 10 * i + 1) for i in range(5)]


def test_calibration_prompts_are_windows_and_prompts_of_the_items_given():
    """calibration_prompts: seeded half-length windows of the items' text end to end, then their
    chat prompts; main hands it the validation split, so nothing of the training items is in it."""
    items = [distill_corpus.DistillSequence(id=f"i{i}", source="man", sampled=False,
                                            tokens=[100 * i + j for j in range(10)], response_start=4)
             for i in range(3)]
    stream = [t for s in items for t in s.tokens]
    got = train_eagle3.calibration_prompts(items, windows=2, serving=5, seq_len=8, seed=1)
    assert got == train_eagle3.calibration_prompts(items, windows=2, serving=5, seq_len=8, seed=1)
    windows, prompts = got[:2], got[2:]
    assert all(len(w) == 4 and any(stream[a:a + 4] == w for a in range(len(stream))) for w in windows)
    assert sorted(prompts) == [[100 * i + j for j in range(4)] for i in range(3)]   # all 3: fewer than 5
    with pytest.raises(SystemExit, match="hold 30 tokens, no more than --seq-len 30"):
        train_eagle3.calibration_prompts(items, windows=1, serving=0, seq_len=30, seed=1)


def test_heldout_chat_prompts_are_rendered_by_the_chat_template(tmp_path):
    """--heldout-chat: each conversation rendered by the target's chat template with the assistant
    turn opened, tokenized as the OpenAI layer's preprocess does."""
    from transformers import AutoTokenizer

    ckpt = Path(make_served_checkpoint(tmp_path / "t", seed=5))
    template = ("{% for m in messages %}<s>{{ m['role'] }}\n{{ m['content'] }}</s>\n{% endfor %}"
                "{% if add_generation_prompt %}<s>assistant\n{% endif %}")
    (ckpt / "tokenizer_config.json").write_text(json.dumps(
        {"chat_template": template, "bos_token": "<s>", "eos_token": "</s>", "unk_token": "<unk>"}))
    chat = tmp_path / "chat.jsonl"
    chat.write_text("\n".join(json.dumps({"kind": "k", "messages": [{"role": "user", "content": c}]})
                              for c in ("the cat", "a dog ran")) + "\n")
    tok = AutoTokenizer.from_pretrained(str(ckpt))
    want = [tok(f"<s>user\n{c}</s>\n<s>assistant\n").input_ids for c in ("the cat", "a dog ran")]
    assert train_eagle3.heldout_chat_prompts(ckpt, chat) == want
    assert all(w[0] == tok.convert_tokens_to_ids("<s>") for w in want)


def test_validation_is_the_training_loss_without_a_step(tmp_path):
    """validation_losses: the loss and top-1 train_step reports on the same window (before its
    update), with no parameter moved; several batches give the mean."""
    target = load_model(make_tiny_checkpoint(tmp_path / "t", "llama", seed=3, num_hidden_layers=4))
    cfg = target.cfg.__class__(**{**target.cfg.__dict__, "num_layers": 1})
    tokens = torch.randint(0, cfg.vocab_size, (2, 16), generator=torch.Generator().manual_seed(1))
    mask = (torch.arange(16) % 3 != 0).float().expand(2, 16)
    d = seeded_drafter(cfg, target)
    before = {n: p.detach().clone() for n, p in d.named_parameters()}
    val = train_eagle3.validation_losses(d, target, [(tokens, mask)], ttt_steps=3, bf16=False)
    twice = train_eagle3.validation_losses(d, target, [(tokens, mask)] * 2, ttt_steps=3, bf16=False)
    assert all(torch.equal(p, before[n]) for n, p in d.named_parameters()) and d.training
    trained = train_eagle3.train_step(d, target, tokens, torch.optim.SGD(d.parameters(), lr=0.1), ttt_steps=3,
                                      loss_mask=mask)
    assert val.ce == pytest.approx(trained.ce, rel=1e-6) and val.top1 == pytest.approx(trained.top1, abs=1e-9)
    assert twice.ce == pytest.approx(val.ce, rel=1e-6) and twice.top1 == pytest.approx(val.top1, abs=1e-9)
    assert not all(torch.equal(p, before[n]) for n, p in d.named_parameters())   # the step did move them


def test_a_distill_run_logs_the_validation_split_every_val_every_steps(tmp_path):
    target = Path(make_tiny_checkpoint(tmp_path / "target", "llama", vocab_size=400, seed=3, num_hidden_layers=4))
    train_tiny_tokenizer(target, 400)
    shards = tmp_path / "d" / "shards"
    shards.mkdir(parents=True)
    rng = torch.Generator().manual_seed(0)
    rows = [json.dumps({"id": f"i{i}", "phase": "response", "source": "man", "messages": [
        {"role": "user", "content": f"question {i}"}], "sampling": {"temperature": 0.0},
        "prompt_ids": torch.randint(3, 400, (12,), generator=rng).tolist(),
        "response_ids": torch.randint(3, 400, (30,), generator=rng).tolist()}) for i in range(24)]
    (shards / "shard-00000.jsonl.gz").write_bytes(gzip_lines(rows))
    out = tmp_path / "out"
    train_eagle3.main(["--target", str(target), "--out", str(out), "--distill-dir", str(tmp_path / "d"),
                       "--validation-share", "0.25", "--work-dir", str(tmp_path / "w"), "--steps", "4",
                       "--val-every", "2", "--seq-len", "32", "--batch", "2", "--calib-prompts", "2",
                       "--calib-new-tokens", "4", "--calib-epochs", "1", "--calib-serving-prompts", "2",
                       "--ckpt-every", "2", "--draft-vocab", "96", "--ttt-steps", "2",
                       "--target-layers", "1", "2", "4"])
    log = [json.loads(r) for r in (out / "train_log.jsonl").read_text().splitlines()]
    assert [r["step"] for r in log if "val_top1" in r] == [2, 4] and all(len(r["val_top1"]) == 2 for r in log[1::2])
    summary = json.loads((out / "training.json").read_text())
    assert summary["validation_top1_per_step"] == [round(t, 4) for t in log[-1]["val_top1"]]
    assert summary["validation_windows"] == 4 and summary["distill_items"]["distill_dirs"] == [(tmp_path / "d").as_posix()]
    assert summary["calibration_prompts"] == {"from": "validation", "corpus_windows": 2, "serving_like": 2}
