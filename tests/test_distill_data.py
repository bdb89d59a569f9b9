"""training/distill_data.py: held-out prompts never enter, a killed run resumes without duplicates
or gaps, and each response is the engine's own output for its prompt (tiny checkpoint)."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

from conftest import make_served_checkpoint

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "training"))
import distill_data  # noqa: E402
import distill_prompts  # noqa: E402
import distill_shards  # noqa: E402
import heldout  # noqa: E402
from distill_prompts import Sources, code_snippet_of, troff_to_text  # noqa: E402

TEMPLATE = ("{% for m in messages %}<s>{{ m['role'] }}\n{{ m['content'] }}</s>\n{% endfor %}"
            "{% if add_generation_prompt %}<s>assistant\n{% endif %}")
FILLER = ("The quick brown fox jumps over the lazy dog while the tools keep their files in order. "
          "Each line of this paragraph is plain prose, long enough to be quoted in a prompt. ")
MAN_PAGE = """.TH FROB 1
.SH NAME
frob \\- frobnicate files
.SH DESCRIPTION
.B frob
reads each \\fIFILE\\fR and frobnicates it in place, keeping a backup copy.
""" + FILLER + """
.TP
\\fB\\-n\\fR, \\fB\\-\\-dry\\-run\\fR
say what would be frobnicated, but change nothing. """ + FILLER + "\n"
MODULE = '''"""A small module about shapes. ''' + FILLER * 2 + '''"""


def area(width, height):
    """The area of a rectangle. ''' + FILLER + '''"""
    if width < 0 or height < 0:
        raise ValueError("negative side")
    result = width * height
    return result


class Square:
    """A square. ''' + FILLER + '''"""

    def __init__(self, side):
        self.side = side

    def area(self):
        return area(self.side, self.side)
'''


@pytest.fixture(scope="module")
def target(tmp_path_factory):
    ckpt = make_served_checkpoint(tmp_path_factory.mktemp("distill") / "tiny-chat", seed=5,
                                  max_position_embeddings=2048)
    (ckpt / "tokenizer_config.json").write_text(json.dumps(
        {"chat_template": TEMPLATE, "bos_token": "<s>", "eos_token": "</s>", "unk_token": "<unk>"}))
    return ckpt


LEAKED = heldout.load_chat()[3].text


@pytest.fixture(scope="module")
def sources(tmp_path_factory):
    root = tmp_path_factory.mktemp("sources")
    (root / "man" / "man1").mkdir(parents=True)
    (root / "man" / "man1" / "frob.1").write_text(MAN_PAGE)
    (root / "man" / "de" / "man1").mkdir(parents=True)
    (root / "man" / "de" / "man1" / "frob.1").write_text(".SH NAME\nfrob \\- Dateien bearbeiten\n.SH BESCHREIBUNG\n"
                                                         + "Liest jede Datei und bearbeitet sie. " * 8 + "\n")
    (root / "doc" / "frob").mkdir(parents=True)
    (root / "doc" / "frob" / "README").write_text(f"Frob\n\n{FILLER}\n\n{FILLER * 2}\n")
    # Every paragraph of this file quotes a held-out chat prompt: nothing of it may be planned.
    (root / "doc" / "leaky").mkdir(parents=True)
    (root / "doc" / "leaky" / "README.md").write_text(
        "\n\n".join(f"Example {i}: {LEAKED.upper()}  {FILLER}" for i in range(3)))
    (root / "stdlib").mkdir()
    (root / "stdlib" / "shapes.py").write_text(MODULE)
    (root / "site" / "frob-1.0.dist-info").mkdir(parents=True)
    (root / "site" / "frob-1.0.dist-info" / "METADATA").write_text(f"Name: frob\nVersion: 1.0\n\n{FILLER * 3}\n")
    return Sources(man=(root / "man",), doc=(root / "doc",), stdlib=(root / "stdlib",), packages=(root / "site",))


def config(target, out, **kw) -> distill_data.DistillConfig:
    base = dict(prompts=14, max_tokens=6, question_tokens=6, max_num_seqs=3, max_model_len=2048,
                shard_size=3, sampled_share=0.5)
    return distill_data.DistillConfig(target, out, **{**base, **kw})


def records(out: Path) -> list[dict]:
    return list(distill_shards.read_records(out / "shards"))


@pytest.fixture(scope="module")
def reference(target, sources, tmp_path_factory):
    out = tmp_path_factory.mktemp("reference")
    summary = distill_data.run(config(target, out), sources)
    return out, summary


def test_heldout_sets_load():
    chat = heldout.load_chat()
    assert len(chat) >= 48
    assert {"explanation", "rewriting", "structured", "multilingual", "copy_heavy", "code"} <= {p.kind for p in chat}
    humaneval = heldout.load_humaneval()
    assert len(humaneval) == 164 and humaneval[0].key == "HumanEval/0"


def test_guard_refuses_equal_and_containing_prompts():
    guard = heldout.HeldoutGuard(heldout.load_all())
    chat, code = heldout.load_chat()[0].text, heldout.load_humaneval()[7].text
    for text in (chat, f"Please answer:  {chat.upper()}\n thanks", f"Complete this:\n{code}"):
        with pytest.raises(heldout.HeldoutLeak):
            guard.check([{"role": "user", "content": text}])
    guard.check([{"role": "user", "content": "Summarise the manual page of ls."}])   # no leak: no raise


def test_plan_drops_heldout_prompts_and_generation_refuses_them(reference, target):
    out, summary = reference
    assert summary["plan"]["refused_heldout"] >= 1 and summary["heldout"] == {"chat": 54, "humaneval": 164}
    guard = heldout.HeldoutGuard(heldout.load_all())
    for r in records(out):
        assert all(guard.leak(m["content"]) is None for m in r["messages"]), r["id"]
        assert "leaky" not in r["origin"]
    leaked = distill_data.Item("x", "response", "doc", "explain", "-", [{"role": "user", "content": f"Explain: {LEAKED}"}],
                               distill_data.Sampling(0.0, None, 4))

    def submit(request):
        raise AssertionError("a held-out prompt reached the engine")

    engine = SimpleNamespace(cfg=SimpleNamespace(max_num_seqs=2), submit=submit)
    with pytest.raises(heldout.HeldoutLeak):
        distill_data.generate(engine, [leaked], distill_data.PromptRenderer(target), guard, lambda r: None, "test")


def test_origins_are_relative_to_the_searched_folder(reference, sources):
    """Committed data names each file from its searched folder down, never the planning
    machine's absolute path (a checkout's .venv, a home directory)."""
    out, _ = reference
    root = str(sources.man[0].parent)
    origins = {r["origin"] for r in records(out)}
    assert all(root not in o and not o.startswith("/") for o in origins), origins
    expected = {"man/man1/frob.1", "man/de/man1/frob.1", "doc/frob/README", "stdlib/shapes.py",
                "site/frob-1.0.dist-info/METADATA"}
    assert expected <= origins, origins


def test_every_source_and_both_samplings_appear(reference):
    out, summary = reference
    got = records(out)
    assert {r["source"] for r in got} >= {"man", "man_i18n", "doc", "stdlib_code", "stdlib_doc", "package_doc", "self"}
    assert {r["sampling"]["temperature"] for r in got} == {0.0, 0.7}
    assert {r["phase"] for r in got} == {"question", "response"}


class Killed(Exception):
    pass


def test_killed_run_resumes_without_duplicates_or_gaps(reference, target, sources, tmp_path):
    want = {r["id"]: r for r in records(reference[0])}
    seen = []

    def kill_after_seven(record):
        seen.append(record["id"])
        if len(seen) == 7:
            raise Killed

    with pytest.raises(Killed):
        distill_data.run(config(target, tmp_path), sources, on_record=kill_after_seven)
    written = [r["id"] for r in records(tmp_path)]
    assert written and set(written) <= set(seen[:6])   # whole shards only: the 7th was never written
    (tmp_path / "shards" / "shard-00002.tmp").write_text('{"id": "half a shard"')   # a kill mid-write
    distill_data.run(config(target, tmp_path, max_num_seqs=2), sources)   # resumed batching narrower
    got = records(tmp_path)
    assert len(got) == len({r["id"] for r in got}) == len(want)
    assert {r["id"]: (r["prompt_ids"], r["response_ids"]) for r in got} == \
        {i: (r["prompt_ids"], r["response_ids"]) for i, r in want.items()}
    assert not list((tmp_path / "shards").glob("*.tmp"))


def test_resuming_with_other_settings_is_refused(reference, target, sources):
    with pytest.raises(distill_data.SettingsChanged, match="max_tokens"):
        distill_data.run(config(target, reference[0], max_tokens=7), sources)


def test_responses_are_the_engines_own_output(reference, target):
    """Each response, batched with others, equals the engine's output for that prompt alone
    (greedy: the greedy tokens; sampled: seeded, so the same tokens whatever the batch)."""
    from specserve.core.engine import GenerationRequest
    from specserve.core.sampling import SamplingParams

    engine = distill_data.build(config(target, reference[0]))
    got = records(reference[0])
    assert any(r["sampling"]["seed"] is None for r in got)
    for r in got:
        s = r["sampling"]
        params = SamplingParams(max_tokens=s["max_tokens"], temperature=s["temperature"], seed=s["seed"])
        alone = engine.generate([GenerationRequest("alone", r["prompt_ids"], params, "none")])["alone"]
        assert alone.new_token_ids == r["response_ids"], r["id"]


def test_troff_markup_is_stripped():
    text = troff_to_text(MAN_PAGE)
    assert "frob - frobnicate files" in text and "-n, --dry-run" in text
    assert ".TH" not in text and "\\f" not in text


def test_code_snippets_are_whole_dedented_definitions():
    """A method quoted alone reads as written: its first line is dedented with its body."""
    import ast
    import random

    method = "    def m{i}(self, x):\n        \"\"\"{doc}\"\"\"\n        y = x + {i}\n        z = y * 2\n        return z\n\n"
    module = "class Box:\n" + "".join(method.format(i=i, doc=FILLER) for i in range(3))
    for seed in range(5):
        snippet = code_snippet_of(module, random.Random(seed))
        assert snippet and snippet.startswith(("def m", "class Box")), snippet[:40]
        ast.parse(snippet)
        if snippet.startswith("def m"):
            assert "\n    y = x + " in snippet and "\n        y" not in snippet


def test_self_instruct_keeps_questions_and_drops_replies():
    import random

    from distill_prompts import self_instruct_prompt

    asked = "Here is a text:\n\nfrob reads files.\n\nWrite one question or instruction that ..."
    for reply in ("I'm ready to help. What's your next question?", "Sure! Here is a question:", "ok"):
        assert self_instruct_prompt(reply, asked, random.Random(0)) is None, reply
    for seed in range(4):
        turn = self_instruct_prompt("Question: How do I frob only some files?\nmore", asked, random.Random(seed))
        assert turn[0]["content"] in ("How do I frob only some files?", "frob reads files.\n\nHow do I frob only some files?")


def test_a_plan_can_leave_out_the_files_an_earlier_plan_drew_from(reference, target, sources, tmp_path):
    """--avoid-plan-of: a second folder of data shares no file (so no snippet) with the first."""
    accept = lambda messages: None   # noqa: E731
    full, _ = distill_prompts.plan_prompts(sources, 14, 0, accept)
    assert "man/man1/frob.1" in {p.origin for p in full}
    part, report = distill_prompts.plan_prompts(sources, 14, 0, accept, avoid_origins=frozenset({"man/man1/frob.1"}))
    assert {p.origin for p in part} == {p.origin for p in full} - {"man/man1/frob.1"}
    assert report.avoided == {"man": 1, "man_i18n": 0, "doc": 0, "stdlib_code": 0, "stdlib_doc": 0, "package_doc": 0}
    assert report.files == distill_prompts.plan_prompts(sources, 14, 0, accept)[1].files   # found, before leaving out

    # Through the tool: the reference folder's plan drew from every fixture file, so nothing is left,
    # and the avoided plan is part of the settings (a resume without it is refused).
    cfg = config(target, tmp_path, avoid_plans=(reference[0],))
    summary = distill_data.run(cfg, sources)
    assert records(tmp_path) == [] and summary["plan"]["planned"] == {k: 0 for k in summary["plan"]["planned"]}
    with pytest.raises(distill_data.SettingsChanged, match="avoid_plans_sha1"):
        distill_data.run(config(target, tmp_path), sources)


def test_shares_reweight_the_sources_and_bad_ones_are_refused(target, sources, tmp_path):
    """--share SOURCE=WEIGHT: one source's weight changes, the rest keep theirs, all scaled to 1."""
    cfg = config(target, tmp_path, shares=(("self", 0.82), ("man", 0.0)))
    shares = cfg.plan_shares()
    # Defaults without man (0.20) and self (0.18) sum to 0.62; with self at 0.82 the total is 1.44.
    assert shares["man"] == 0 and shares["self"] == pytest.approx(0.82 / 1.44)
    assert shares["stdlib_code"] == pytest.approx(0.22 / 1.44) and sum(shares.values()) == pytest.approx(1)
    assert cfg.settings()["shares"] == shares
    assert "shares" not in config(target, tmp_path).settings()   # folders planned before the option
    accept = lambda messages: None   # noqa: E731
    planned, report = distill_prompts.plan_prompts(sources, 14, 0, accept, shares=shares)
    assert report.planned["man"] == 0 and not any(p.source == "man" for p in planned)
    with pytest.raises(ValueError, match="unknown prompt source 'chat'; sources: man, man_i18n"):
        config(target, tmp_path, shares=(("chat", 1.0),)).plan_shares()
    with pytest.raises(ValueError, match="share of 'self' is negative"):
        config(target, tmp_path, shares=(("self", -1.0),)).plan_shares()
    with pytest.raises(SystemExit):
        distill_data.main(["--target", str(target), "--out", str(tmp_path), "--share", "self"])
