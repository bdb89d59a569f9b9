"""The benchmark's metric computations on scripted event streams, and its workload mix.

Expected values are worked out by hand in the comments; no server, no clocks."""

from __future__ import annotations

import math
import random

import pytest

from specserve.cli.bench import metrics
from specserve.cli.bench.events import Chunk, RequestRecord, Window
from specserve.cli.bench.workload import TextSource, bucket_counts, build_workload, plan_buckets


def streamed() -> RequestRecord:
    # Sent at 10.0; tokens arrive 1 at 10.5 (prefill), 2 at 10.7 (a draft accepted), 1 at 11.0;
    # the final (empty) response at 11.25.
    return RequestRecord(0, "ngram", "short", send_t=10.0,
                         chunks=[Chunk(10.5, 1), Chunk(10.75, 2), Chunk(11.0, 1)], end_t=11.25,
                         num_output_tokens=4)


def one_chunk(tokens: int = 1) -> RequestRecord:
    return RequestRecord(1, "none", "short", send_t=0.0, chunks=[Chunk(0.25, tokens)], end_t=0.25,
                         num_output_tokens=tokens)


def errored() -> RequestRecord:
    return RequestRecord(2, "none", "short", send_t=1.0, chunks=[Chunk(1.5, 1)], end_t=2.0,
                         num_output_tokens=1, error="prompt too long")


def test_per_request_latencies():
    r = streamed()
    assert metrics.ttft(r) == 0.5
    assert metrics.tpot(r) == pytest.approx(0.5 / 3, abs=1e-12)   # (11.0 − 10.5) / (4 − 1)
    assert metrics.inter_token_latencies(r) == [0.25, 0.25]
    assert metrics.e2e(r) == 1.25


def test_a_response_without_tokens_does_not_count_as_the_first_token():
    # A held-back partial character still carries its token; a response with no tokens does not.
    r = RequestRecord(0, "none", "short", send_t=0.0,
                      chunks=[Chunk(0.5, 0), Chunk(1.0, 1), Chunk(1.5, 1)], end_t=1.5, num_output_tokens=2)
    assert metrics.ttft(r) == 1.0
    assert metrics.tpot(r) == 0.5
    assert metrics.inter_token_latencies(r) == [0.5]


@pytest.mark.parametrize("tokens", [1, 3])
def test_one_chunk_request_has_ttft_and_e2e_but_no_tpot(tokens):
    r = one_chunk(tokens)
    assert metrics.ttft(r) == 0.25 and metrics.e2e(r) == 0.25
    assert metrics.tpot(r) is None           # no interval between two token-carrying responses
    assert metrics.inter_token_latencies(r) == []


def test_errored_request_is_never_timed():
    r = errored()
    assert (metrics.ttft(r), metrics.tpot(r), metrics.e2e(r)) == (None, None, None)
    assert metrics.inter_token_latencies(r) == []
    no_end = RequestRecord(3, "none", "short", send_t=0.0, chunks=[Chunk(0.1, 1)], num_output_tokens=1)
    assert not no_end.ok and metrics.e2e(no_end) is None


def test_percentiles_linear_between_ranks():
    xs = [4.0, 1.0, 3.0, 2.0]
    assert metrics.percentile(xs, 50) == 2.5                       # rank 1.5
    assert metrics.percentile(xs, 90) == pytest.approx(3.7)        # rank 2.7
    assert metrics.percentile(xs, 99) == pytest.approx(3.97)       # rank 2.97
    assert metrics.percentile(xs, 0) == 1.0 and metrics.percentile(xs, 100) == 4.0
    assert metrics.percentile([5.0], 99) == 5.0
    with pytest.raises(ValueError):
        metrics.percentile([], 50)


def test_distribution_mean_std_and_none_filtering():
    d = metrics.distribution([1.0, None, 2.0, 3.0, 4.0])
    assert (d.n, d.mean, d.min, d.max) == (4, 2.5, 1.0, 4.0)
    assert d.std == pytest.approx(math.sqrt(1.25))                 # population: Σ(x − 2.5)² / 4
    assert (d.p50, d.p90) == (2.5, pytest.approx(3.7))
    single = metrics.distribution([0.3])
    assert (single.std, single.p50, single.p99) == (0.0, 0.3, 0.3)
    assert metrics.distribution([]) is None and metrics.distribution([None]) is None


def test_throughput_over_summed_windows_and_zero_duration_guard():
    recs = [streamed(), one_chunk(), errored()]
    # Two blocks of 2 s each: 4 + 1 tokens (the errored request's token does not count).
    t = metrics.throughput(recs, [Window("none", 0.0, 2.0), Window("none", 5.0, 7.0)])
    assert (t["duration_s"], t["output_tokens"], t["completed"]) == (4.0, 5, 2)
    assert (t["output_throughput"], t["request_throughput"]) == (1.25, 0.5)
    z = metrics.throughput(recs, [Window("none", 3.0, 3.0)])
    assert z["output_throughput"] is None and z["request_throughput"] is None
    assert metrics.throughput([], [])["output_throughput"] is None


def _stats(steps, drafts, draft_tokens, accepted, rates, draft_s=0.0, verify_s=0.0):
    return {"method": "ngram", "steps": steps, "drafts": drafts, "draft_tokens": draft_tokens,
            "accepted_tokens": accepted, "mean_acceptance_length": 0.0,
            "acceptance_rate_per_position": rates, "proposer_errors": 0,
            "draft_seconds": draft_s, "verify_seconds": verify_s}


def test_acceptance_length_and_draft_tokens_per_step_are_step_weighted():
    a, b, bad = streamed(), one_chunk(), errored()
    a.spec_stats = _stats(10, 8, 32, 12, [0.75, 0.5])
    b.spec_stats = _stats(5, 2, 8, 1, [0.5])
    bad.spec_stats = _stats(100, 100, 400, 400, [1.0])            # errored: ignored
    s = metrics.speculation([a, b, bad])
    assert s["mean_acceptance_length"] == pytest.approx((12 + 1 + 15) / 15)   # (accepted + steps) / steps
    assert s["draft_tokens_per_step"] == pytest.approx(40 / 15)
    # Position 0: (0.75·8 + 0.5·2) / 10 drafting steps; position 1: 0.5·8 / 10.
    assert s["acceptance_rate_per_position"] == pytest.approx([0.7, 0.4])
    assert (s["steps"], s["draft_tokens"], s["accepted_tokens"]) == (15, 40, 13)
    plain = metrics.speculation([a])
    assert plain["mean_acceptance_length"] == pytest.approx(2.2)
    empty = metrics.speculation([one_chunk()])                      # no stats reported
    assert empty["mean_acceptance_length"] is None and empty["draft_tokens_per_step"] is None
    assert empty["draft_ms_per_step"] is None and empty["drafting_step_share"] is None


def test_step_time_splits_into_draft_and_verify_per_step():
    a, b = streamed(), one_chunk()
    a.spec_stats = _stats(10, 8, 32, 12, [0.75, 0.5], draft_s=0.05, verify_s=0.6)
    b.spec_stats = _stats(5, 2, 8, 1, [0.5], draft_s=0.01, verify_s=0.3)
    s = metrics.speculation([a, b])
    assert s["draft_ms_per_step"] == pytest.approx(1000 * 0.06 / 15)
    assert s["verify_ms_per_step"] == pytest.approx(1000 * 0.9 / 15)
    assert s["drafting_step_share"] == pytest.approx(10 / 15)      # steps that drafted anything


def test_summary_counts_errors_and_times_only_successes():
    s = metrics.summarize([streamed(), one_chunk(), errored()], [Window("ngram", 0.0, 2.5)])
    assert (s["requests"], s["errors"], s["completed"]) == (3, 1, 2)
    assert s["error_messages"] == ["prompt too long"]
    assert s["ttft_s"]["n"] == 2 and s["ttft_s"]["mean"] == pytest.approx(0.375)
    assert s["tpot_s"]["n"] == 1
    assert s["itl_s"]["n"] == 2
    assert s["e2e_s"]["max"] == 1.25
    assert s["output_throughput"] == 2.0                             # 5 tokens / 2.5 s


def test_speedup_is_oriented_so_bigger_is_faster():
    none = {"output_throughput": 100.0, "request_throughput": 2.0,
            "e2e_s": {"p50": 3.0, "p90": 4.0, "p99": 6.0, "mean": 3.0},
            "ttft_s": {"p50": 0.2}, "tpot_s": {"mean": 0.03, "p50": 0.03}, "itl_s": {"p50": 0.03}}
    fast = {"output_throughput": 150.0, "request_throughput": 3.0,
            "e2e_s": {"p50": 2.0, "p90": 2.0, "p99": 4.0, "mean": 2.5},
            "ttft_s": {"p50": 0.25}, "tpot_s": {"mean": 0.02, "p50": 0.015}, "itl_s": {"p50": 0.06}}
    x = metrics.speedup(fast, none)
    assert x["output_throughput"] == 1.5 and x["request_throughput"] == 1.5
    assert (x["e2e_p50"], x["e2e_p90"], x["e2e_p99"], x["e2e_mean"]) == (1.5, 2.0, 1.5, 1.2)
    assert x["ttft_p50"] == 0.8 and x["tpot_p50"] == 2.0 and x["itl_p50"] == 0.5
    assert x["tpot_mean"] == pytest.approx(1.5)
    gone = metrics.speedup({"output_throughput": None, "e2e_s": None}, none)
    assert gone["output_throughput"] is None and gone["e2e_p50"] is None
    assert metrics.speedup(fast, {**none, "output_throughput": 0.0})["output_throughput"] is None


def test_identical_outputs_matches_by_workload_request():
    ref = [RequestRecord(i, "none", "short", 0.0, end_t=1.0, text=t) for i, t in enumerate("abc")]
    got = [RequestRecord(i, "ngram", "short", 0.0, end_t=1.0, text=t) for i, t in zip((2, 0, 1), "cXb")]
    assert metrics.identical_outputs(got, ref) == pytest.approx(2 / 3)
    assert metrics.identical_outputs([], ref) is None


# -- workload ------------------------------------------------------------------------------------
def test_bucket_counts_largest_remainder():
    shares = [0.80, 0.15, 0.05]
    assert bucket_counts(100, shares) == [80, 15, 5]
    assert bucket_counts(20, shares) == [16, 3, 1]
    assert bucket_counts(10, shares) == [8, 2, 0]     # 8 / 1.5 / 0.5: the tie goes to medium
    assert bucket_counts(1, shares) == [1, 0, 0]
    assert bucket_counts(0, shares) == [0, 0, 0]
    assert all(sum(bucket_counts(n, shares)) == n for n in range(200))


def test_buckets_are_capped_by_the_model_length():
    short, medium, long = plan_buckets(20, max_model_len=2048, min_output=32)
    assert (short.lo, short.hi, medium.lo, medium.hi, long.lo, long.hi) == (1, 127, 128, 1024, 1025, 2016)
    assert not (short.capped or medium.capped or long.capped)
    short, medium, long = plan_buckets(20, max_model_len=512, min_output=32)
    assert (medium.lo, medium.hi, medium.capped) == (128, 480, True)
    assert (long.lo, long.hi, long.capped) == (480, 480, True)
    assert not short.capped


def word_source() -> TextSource:
    """A whitespace 'tokenizer' over words w0…w99: token counts are word counts."""
    encode = lambda s: [int(w[1:]) for w in s.split()]  # noqa: E731
    decode = lambda ids: " ".join(f"w{i}" for i in ids)  # noqa: E731
    rng = random.Random(1)
    shorts = [" ".join(f"w{rng.randrange(100)}" for _ in range(rng.randint(5, 60))) for _ in range(30)]
    docs = [" ".join(f"w{(i * 7 + d) % 100}" for i in range(3000)) for d in range(3)]
    return TextSource(shorts, docs, encode, decode)


def test_workload_mix_lengths_and_fit():
    reqs, plans = build_workload(word_source(), 100, 2048, seed=3, output_range=(32, 512))
    by = {p.name: [r for r in reqs if r.bucket == p.name] for p in plans}
    assert {k: len(v) for k, v in by.items()} == {"short": 80, "medium": 15, "long": 5}
    assert all(r.num_prompt_tokens < 128 for r in by["short"])
    assert all(128 <= r.num_prompt_tokens <= 1024 for r in by["medium"])
    assert all(r.num_prompt_tokens > 1024 for r in by["long"])
    assert all(32 <= r.max_tokens <= 512 and r.num_prompt_tokens + r.max_tokens <= 2048 for r in reqs)
    assert [r.index for r in reqs] == list(range(100))
    assert [r.bucket for r in reqs[:20]].count("short") < 20      # shuffled, not grouped
    src = word_source()
    assert all(len(src.encode(r.prompt)) == r.num_prompt_tokens for r in reqs)


def test_workload_is_deterministic_by_seed():
    a, _ = build_workload(word_source(), 40, 2048, seed=7)
    b, _ = build_workload(word_source(), 40, 2048, seed=7)
    c, _ = build_workload(word_source(), 40, 2048, seed=8)
    assert a == b
    assert a != c


def test_workload_on_a_short_model_fits_every_request():
    reqs, plans = build_workload(word_source(), 20, 256, seed=0, output_range=(32, 512))
    assert all(r.num_prompt_tokens + r.max_tokens <= 256 and r.max_tokens >= 32 for r in reqs)
    assert [p.capped for p in plans] == [False, True, True]
    with pytest.raises(ValueError):
        build_workload(word_source(), 5, 32, output_range=(32, 64))


def test_prompts_file_takes_json_lines_or_plain_lines(tmp_path):
    from specserve.cli.bench.workload import read_prompts_file

    f = tmp_path / "p.jsonl"
    f.write_text('{"prompt": "def f(x):", "id": 3}\nplain text line\n\n"a JSON string"\n')
    assert read_prompts_file(f) == ["def f(x):", "plain text line", "a JSON string"]


# -- interleaving and arrivals (runner's pure helpers) ----------------------------------------------
def test_blocks_rotate_and_poisson_arrivals():
    from specserve.cli.bench.runner import blocks, poisson_offsets, rotate

    assert [len(b) for b in blocks(list(range(5)), 2)] == [2, 2, 1]
    methods = ["none", "ngram", "eagle"]
    assert [rotate(methods, k) for k in range(4)] == [
        ["none", "ngram", "eagle"], ["ngram", "eagle", "none"], ["eagle", "none", "ngram"], ["none", "ngram", "eagle"]]
    a = poisson_offsets(2000, 4.0, seed=1)
    assert a == poisson_offsets(2000, 4.0, seed=1) and a != poisson_offsets(2000, 4.0, seed=2)
    assert a[0] == 0.0 and all(y > x for x, y in zip(a, a[1:]))
    assert a[-1] / 1999 == pytest.approx(1 / 4.0, rel=0.1)    # mean gap 1/λ
