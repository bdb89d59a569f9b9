"""Peers in the same run: transformers on the same checkpoint, the same prompts, the same budgets.

    hf_generate        model.generate greedy (KV cache)
    hf_prompt_lookup   model.generate greedy with prompt_lookup_num_tokens (transformers' n-gram
                       drafting, set like our `ngram`: 4 draft tokens, n-grams up to 3)
    hf_assisted        model.generate greedy with assistant_model=<draft model>; only when a draft
                       model is configured, otherwise reported as not run, with the reason

transformers' generate serves one request at a time (prompt lookup and assisted generation need
batch size 1), so the specserve side of this comparison is specserve at concurrency 1 over gRPC
streaming, on the same requests, interleaved request by request with the peers in rotating
order. The figure compared is output tokens / second of wall time per request stream (E2E, prompt
processing included on both sides). Ratios: each peer ÷ specserve `none`, and ÷ specserve's best
method (the fastest specserve method in this comparison).
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Callable, Sequence

from specserve.cli.bench.runner import StreamDriver, rotate
from specserve.cli.bench.workload import WorkloadRequest

HF_NGRAM = {"prompt_lookup_num_tokens": 4, "max_matching_ngram_size": 3}


def _hf_runner(model, tokenizer, extra: dict) -> Callable[[WorkloadRequest], tuple[int, float, str]]:
    import torch

    pad = model.generation_config.pad_token_id
    if pad is None:
        eos = model.generation_config.eos_token_id
        pad = (eos[0] if isinstance(eos, list) else eos) if eos is not None else 0

    def run(req: WorkloadRequest) -> tuple[int, float, str]:
        ids = torch.tensor([tokenizer.encode(req.prompt, add_special_tokens=True).ids])
        t0 = time.perf_counter()
        with torch.inference_mode():
            out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=req.max_tokens,
                                 do_sample=False, pad_token_id=pad, **extra)
        dt = time.perf_counter() - t0
        new = out[0, ids.shape[1]:].tolist()
        return len(new), dt, tokenizer.decode(new, skip_special_tokens=True)
    return run


def calibrate_threads(run: Callable[[WorkloadRequest], tuple[int, float, str]], probe: WorkloadRequest,
                      candidates: Sequence[int]) -> tuple[int, dict[int, float]]:
    """The torch thread count at which transformers decodes fastest here. On a small CPU shared
    with other work, more threads can be far slower (each of generate's many small ops waits for
    a descheduled sibling thread), so the peers get the better of the candidates: it favours
    them, which keeps any specserve advantage conservative."""
    import torch

    seconds_per_token = {}
    for n in candidates:
        torch.set_num_threads(n)
        run(probe)  # warm
        tokens, dt, _ = run(probe)
        seconds_per_token[n] = dt / max(1, tokens)
    best = min(seconds_per_token, key=seconds_per_token.get)
    torch.set_num_threads(best)
    return best, seconds_per_token


def run_peers(checkpoint: Path, requests: list[WorkloadRequest], spec_methods: list[str], driver: StreamDriver,
              *, draft_model: Path | None = None, thread_candidates: Sequence[int] = (1,), log=print) -> dict:
    import torch
    import transformers

    from specserve.model.tokenizer import load_tokenizer

    tokenizer = load_tokenizer(checkpoint)
    model = transformers.AutoModelForCausalLM.from_pretrained(str(checkpoint), dtype=torch.float32).eval()
    probe = WorkloadRequest(-1, "calibration", requests[0].prompt, requests[0].num_prompt_tokens, 16)
    threads, calibration = calibrate_threads(_hf_runner(model, tokenizer, {}), probe,
                                             sorted(set(thread_candidates)))
    log(f"  peers: transformers at {threads} torch thread(s) (seconds per token: "
        + ", ".join(f"{n} threads {t:.3f}" for n, t in calibration.items()) + ")")
    systems: dict[str, Callable[[WorkloadRequest], tuple[int, float, str]]] = {
        "hf_generate": _hf_runner(model, tokenizer, {}),
        "hf_prompt_lookup": _hf_runner(model, tokenizer, dict(HF_NGRAM)),
    }
    not_run = {}
    if draft_model is None:
        not_run["hf_assisted"] = "no draft model configured (--draft-model)"
    else:
        draft = transformers.AutoModelForCausalLM.from_pretrained(str(draft_model), dtype=torch.float32).eval()
        systems["hf_assisted"] = _hf_runner(model, tokenizer, {"assistant_model": draft})

    def specserve(method: str):
        def run(req: WorkloadRequest) -> tuple[int, float, str]:
            rec = driver.run(req, method)
            if not rec.ok:
                raise RuntimeError(f"specserve {method}: {rec.error}")
            return rec.num_output_tokens, rec.end_t - rec.send_t, rec.text
        return run

    for m in spec_methods:
        systems[f"specserve_{m}"] = specserve(m)

    names = list(systems)
    warm = WorkloadRequest(-1, "warmup", requests[0].prompt, requests[0].num_prompt_tokens, 4)
    for name in names:  # first calls pay one-off setup (allocator, graph caches, connections)
        systems[name](warm)
    totals = {n: {"requests": 0, "output_tokens": 0, "time_s": 0.0} for n in names}
    texts: dict[str, list[str]] = {n: [] for n in names}
    for i, req in enumerate(requests):
        for name in rotate(names, i):
            n_tok, dt, text = systems[name](req)
            totals[name]["requests"] += 1
            totals[name]["output_tokens"] += n_tok
            totals[name]["time_s"] += dt
            texts[name].append(text)
        log(f"  peers request {i + 1}/{len(requests)}: " + ", ".join(
            f"{n} {totals[n]['output_tokens'] / max(totals[n]['time_s'], 1e-9):.1f} tok/s" for n in names))

    for t in totals.values():
        t["output_throughput"] = t["output_tokens"] / t["time_s"] if t["time_s"] > 0 else None
    spec = {m: totals[f"specserve_{m}"]["output_throughput"] for m in spec_methods}
    best = max((m for m in spec if spec[m] is not None), key=lambda m: spec[m], default=None)
    base_none = spec.get("none")
    base_best = spec.get(best) if best else None
    reference = texts.get("specserve_none") or texts.get(f"specserve_{best}")
    out = {}
    for name in names:
        tps = totals[name]["output_throughput"]
        same = sum(a == b for a, b in zip(texts[name], reference)) / len(reference) if reference else None
        out[name] = {"status": "run", **totals[name],
                     "ratio_to_specserve_none": tps / base_none if tps and base_none else None,
                     "ratio_to_specserve_best": tps / base_best if tps and base_best else None,
                     "identical_text_to_specserve_none": same}
    for name, reason in not_run.items():
        out[name] = {"status": "not run", "reason": reason}
    return {"status": "run", "concurrency": 1, "num_requests": len(requests), "specserve_best": best,
            "torch_threads": threads, "thread_calibration_s_per_token": {str(k): v for k, v in calibration.items()},
            "hf_prompt_lookup_settings": HF_NGRAM,
            "draft_model": str(draft_model) if draft_model else None, "systems": out}
