"""Timing table for `make gpu-check`: a random-weight Llama-3-8B-shaped target in bf16 on a GPU.

    python benchmarks/gpu_check.py --out docs/gpu            # on a GPU machine (make gpu-check)
    python benchmarks/gpu_check.py --tiny --device cpu       # the same code on a tiny model (CPU test)

At batch 1, 4 and 16 (contexts of --context tokens):
  - static step time per K (the captured target verify + acceptance, `static_step.target_step`);
  - plain decoding tokens/s: the engine's `none` vs transformers `generate` with a static cache;
  - dspark vs dynamic eagle: mean step time and the standard deviation of step time (= inter-token
    latency std, one streamed response per step) over a generation, with a random-weight EAGLE
    drafter of the same shape and a fixed draft length (random drafts are rarely accepted, so
    this times the machinery, not acceptance);
  - tensor parallelism with N = the number of GPUs this machine has (the largest N up to it that
    divides the heads, said when smaller), NCCL: a random 2-layer Llama-3-8B-shaped checkpoint
    (vocabulary 32000) served whole on cuda:0 and sharded over cuda:0 … N−1: the largest logit
    difference, whether greedy decoding agrees, and ms per decoded token of each. On a machine
    with one GPU (or on CPU) it is skipped, and the report and the table say why.
Weights are random: figures are timings only. Writes table.md and timing.json under --out.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

LLAMA3_8B = dict(hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
                 num_key_value_heads=8, vocab_size=128256, max_position_embeddings=8192, rope_theta=500000.0)
TINY = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, vocab_size=512, max_position_embeddings=1024, rope_theta=10000.0)


# The tensor-parallel check's target: Llama-3-8B's layer shape, 2 layers and a 32000 vocabulary so
# that writing its checkpoint takes seconds.
TP_SHAPE = {**LLAMA3_8B, "num_hidden_layers": 2, "vocab_size": 32000}


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", default="cuda")
    p.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float32"))
    p.add_argument("--batches", default="1,4,16")
    p.add_argument("--ks", default="1,2,4,8")
    p.add_argument("--context", type=int, default=512, help="tokens already in each row's KV")
    p.add_argument("--new-tokens", type=int, default=64, help="tokens per request for the throughput rows")
    p.add_argument("--reps", type=int, default=20, help="timed replays per step-time cell")
    p.add_argument("--tiny", action="store_true", help="a tiny model (CPU test of this script)")
    p.add_argument("--no-hf", action="store_true", help="skip transformers generate")
    p.add_argument("--no-tp", action="store_true", help="skip the tensor-parallel check")
    p.add_argument("--out", type=Path)
    args = p.parse_args(argv)
    args.batches = [int(x) for x in args.batches.split(",")]
    args.ks = [int(x) for x in args.ks.split(",")]
    return args


def hf_config(args) -> dict:
    shape = TINY if args.tiny else LLAMA3_8B
    return {"model_type": "llama", "architectures": ["LlamaForCausalLM"], "hidden_act": "silu",
            "rms_norm_eps": 1e-5, "tie_word_embeddings": False, "bos_token_id": 1, "eos_token_id": 2, **shape}


def random_target(args):
    from specserve.model.transformer import ModelConfig, Transformer

    cfg = ModelConfig.from_hf(hf_config(args))
    torch.manual_seed(0)
    with torch.device(args.device):
        model = Transformer(cfg).to(getattr(torch, args.dtype))
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0, 0.02)
    return model.eval().requires_grad_(False)


def random_drafter(model):
    from specserve.methods.eagle.drafter import EagleDrafter

    cfg = model.cfg.__class__(**{**model.cfg.__dict__, "num_layers": 1})
    with torch.device(model.device):
        d = EagleDrafter(cfg, calibration=False).to(model.dtype)
    with torch.no_grad():
        for p in d.parameters():
            p.normal_(0, 0.02)
    return d.eval().requires_grad_(False)


def _sync(device) -> None:
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize()


def _median_ms(fn, reps: int, device) -> float:
    fn()
    _sync(device)
    ts = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        _sync(device)
        ts.append(time.perf_counter() - t0)
    return 1000 * statistics.median(ts)


@torch.inference_mode()
def step_times(model, args) -> dict:
    """ms per static step (verify of K+1 positions + acceptance), graph-replayed on CUDA."""
    from specserve.core.cuda_graphs import GraphCache
    from specserve.core.static_step import DeviceKV, SamplingTensors, StepInputs, span_for, target_step

    out = {}
    max_b = max(args.batches)
    cache = model.new_cache(max_b + 1, args.context + max(args.ks) + 2)
    kv = DeviceKV(cache)
    dev = model.device
    span = span_for(args.context + max(args.ks) + 1, cache.max_len, "full")

    def make_fn(key):
        B, K = key

        def fn(x):
            inp = StepInputs(x["tokens"], x["lengths"], x["slots"], x["draft_lens"],
                             SamplingTensors.from_params([None] * B, dev), x["uniforms"])
            res = target_step(model, kv, inp, span, sampled=False)
            return {"out": torch.cat([res.emitted, res.counts[:, None]], 1)}
        return fn

    def example(key):
        B, K = key
        return {"tokens": torch.zeros(B, K + 1, dtype=torch.long, device=dev),
                "lengths": torch.full((B,), args.context, device=dev),
                "slots": torch.arange(B, device=dev), "draft_lens": torch.full((B,), K, device=dev),
                "uniforms": torch.ones(B, K + 1, device=dev)}

    graphs = GraphCache(make_fn, example, dev)
    for B in args.batches:
        for K in [0, *args.ks]:
            g = graphs.get((B, K))
            out[f"B={B},K={K}"] = round(_median_ms(lambda: g({}), args.reps, dev), 3)
    return out


def _engine(model, method_proposers, max_num_seqs, max_len, max_draft_len):
    from specserve.core.engine import Engine, EngineConfig

    return Engine(model, EngineConfig(max_num_seqs=max_num_seqs, max_model_len=max_len, max_draft_len=max_draft_len),
                  method_proposers, eos_token_ids=())


def _requests(method, B, args, vocab):
    from specserve.core.engine import GenerationRequest
    from specserve.core.sampling import SamplingParams

    g = torch.Generator().manual_seed(B)
    return [GenerationRequest(f"{method}{i}", torch.randint(3, vocab, (args.context,), generator=g).tolist(),
                              SamplingParams(max_tokens=args.new_tokens, ignore_eos=True), method) for i in range(B)]


@torch.inference_mode()
def _timed_generation(engine, reqs, device) -> dict:
    """Per-step wall times (each step streams one response per row: the inter-token latency)."""
    for r in reqs:
        engine.submit(r)
    engine.step()  # the prefill step is not an inter-token gap
    steps, tokens = [], 0
    while engine.has_work():
        _sync(device)
        t0 = time.perf_counter()
        outs = engine.step()
        _sync(device)
        steps.append(time.perf_counter() - t0)
        tokens += sum(len(o.new_token_ids) for o in outs)
    total = sum(steps)
    return {"tokens_per_s": round(tokens / total, 1) if total else None,
            "step_ms": round(1000 * statistics.mean(steps), 3) if steps else None,
            "step_std_ms": round(1000 * statistics.pstdev(steps), 3) if steps else None}


def methods(model, args) -> dict:
    from specserve.methods.dspark.proposer import DSParkProposer
    from specserve.methods.eagle.proposer import EagleProposer

    drafter = random_drafter(model)
    out = {}
    max_len = args.context + args.new_tokens + 16
    for B in args.batches:
        kw = dict(max_num_seqs=B, max_model_len=max_len, max_draft_len=4, threshold=None)
        engine = _engine(model, {"dspark": DSParkProposer(drafter, model, **kw),
                                 "eagle": EagleProposer(drafter, model, **kw)}, B, max_len, 4)
        if model.device.type == "cuda":
            engine.proposers["dspark"].warm()
        row = {}
        for method in ("none", "eagle", "dspark", "none", "eagle", "dspark"):  # second round kept (warm)
            row[method] = _timed_generation(engine, _requests(method, B, args, model.cfg.vocab_size), model.device)
        out[f"B={B}"] = row
        del engine
    return out


def _tp_world(gpus: int, cfg: dict) -> int:
    """The largest N <= gpus that divides the query heads, the KV heads and the MLP width."""
    return max(n for n in range(1, gpus + 1) if not (cfg["num_attention_heads"] % n or cfg["num_key_value_heads"] % n
                                                     or cfg["intermediate_size"] % n))


def tensor_parallel_check(args) -> dict:
    """N = this machine's GPU count: logits and greedy decoding of the sharded target against the
    whole one, and ms per decoded token of each. {"skipped": why} where it cannot run. Rank r
    runs on --device's index + r."""
    if not model_device_is_cuda(args):
        return {"skipped": f"not on CUDA (--device {args.device}): NCCL needs GPUs"}
    gpus = torch.cuda.device_count()
    if gpus < 2:
        return {"skipped": f"this machine has {gpus} GPU; tensor parallelism needs 2 or more"}
    import tempfile

    import transformers

    from specserve.core.engine import GenerationRequest
    from specserve.core.sampling import SamplingParams
    from specserve.model.tp_processes import start_tensor_parallel
    from specserve.model.transformer import load_model

    shape = {**hf_config(args), **({} if args.tiny else TP_SHAPE)}
    device = torch.device(args.device)
    device = torch.device(device.type, device.index or 0)   # rank r on device index + r
    world = _tp_world(gpus, shape)
    print(f"gpu_check: tensor-parallel check with N = {world} (this machine has {gpus} GPUs)", flush=True)
    dtype = getattr(torch, args.dtype)
    out = {"gpus": gpus, "world": world,
           "model": "tiny random llama" if args.tiny else "random 2-layer Llama-3-8B shape, vocabulary 32000"}
    with tempfile.TemporaryDirectory(prefix="gpu-check-tp-") as ckpt:
        torch.manual_seed(0)
        hf = transformers.LlamaForCausalLM(transformers.LlamaConfig(**shape)).to(dtype)
        with torch.no_grad():
            for p in hf.parameters():
                p.normal_(0, 0.02)
        hf.save_pretrained(ckpt)
        del hf
        whole = load_model(ckpt, dtype=dtype, device=device)
        sharded = start_tensor_parallel(ckpt, world, dtype=dtype, device=device)
        try:
            tokens = torch.randint(3, shape["vocab_size"], (2, 64), generator=torch.Generator().manual_seed(0))
            with torch.inference_mode():
                diff = (whole.score(tokens.to(device)).float() - sharded.score(tokens.to(device)).float()).abs().max()
            out["max_abs_logit_diff"] = round(float(diff), 4)
            greedy, ms = {}, {}
            for name, model in (("1", whole), (str(world), sharded)):
                engine = _engine(model, {}, 1, 256, 1)
                reqs = [GenerationRequest("r", tokens[0].tolist(), SamplingParams(max_tokens=64, ignore_eos=True),
                                          "none")]
                greedy[name] = engine.generate(reqs)["r"].new_token_ids
                ms[name] = _timed_generation(engine, [dataclasses.replace(reqs[0], request_id="t")],
                                             model.device)["step_ms"]
            out["greedy_equal"] = greedy["1"] == greedy[str(world)]
            out["ms_per_token"] = ms
        finally:
            sharded.close()
    return out


def hf_generate(args) -> dict:
    """transformers generate, greedy, static cache, random weights of the same shape."""
    import transformers

    cfg = transformers.LlamaConfig(**{k: v for k, v in hf_config(args).items() if k != "architectures"})
    torch.manual_seed(0)
    with torch.device(args.device):
        model = transformers.LlamaForCausalLM(cfg).to(getattr(torch, args.dtype)).eval()
    out = {}
    for B in args.batches:
        ids = torch.randint(3, cfg.vocab_size, (B, args.context), device=args.device)
        gen = lambda: model.generate(ids, max_new_tokens=args.new_tokens, min_new_tokens=args.new_tokens,
                                     do_sample=False, cache_implementation="static", pad_token_id=0)
        gen()  # warm-up (compiles / allocates the static cache)
        _sync(args.device)
        t0 = time.perf_counter()
        gen()
        _sync(args.device)
        out[f"B={B}"] = round(B * args.new_tokens / (time.perf_counter() - t0), 1)
    del model
    return out


def build_table(report: dict, args) -> str:
    ks = [0, *args.ks]
    lines = [f"# GPU timing: {report['model']} ({report['device']}, {args.dtype}, context {args.context})", "",
             "## Static step time (ms), verify of K+1 positions + acceptance", "",
             "| batch | " + " | ".join(f"K={k}" for k in ks) + " |", "|---" * (len(ks) + 1) + "|"]
    for B in args.batches:
        lines.append(f"| {B} | " + " | ".join(f"{report['step_ms'][f'B={B},K={k}']:.2f}" for k in ks) + " |")
    lines += ["", "## Decoding (random weights; eagle/dspark: K = 4, no calibration cut)", "",
              "| batch | none tok/s | transformers generate tok/s | none / generate | eagle step ms (std) "
              "| dspark step ms (std) | dspark / eagle ITL std |", "|---|---|---|---|---|---|---|"]
    for B in args.batches:
        m = report["methods"][f"B={B}"]
        hf = report.get("hf_generate", {}).get(f"B={B}")
        ratio = f"{m['none']['tokens_per_s'] / hf:.2f}" if hf else "-"
        std = (m["dspark"]["step_std_ms"] / m["eagle"]["step_std_ms"]) if m["eagle"]["step_std_ms"] else float("nan")
        lines.append(f"| {B} | {m['none']['tokens_per_s']} | {hf if hf else '-'} | {ratio} | "
                     f"{m['eagle']['step_ms']} ({m['eagle']['step_std_ms']}) | "
                     f"{m['dspark']['step_ms']} ({m['dspark']['step_std_ms']}) | {std:.2f} |")
    tp = report.get("tensor_parallel")
    if tp is not None:
        lines += ["", "## Tensor parallelism (NCCL)", ""]
        if "skipped" in tp:
            lines.append(f"Skipped: {tp['skipped']}.")
        else:
            w = str(tp["world"])
            lines += [f"{tp['model']}, N = {w} on a machine with {tp['gpus']} GPUs.", "",
                      "| N | ms per decoded token (batch 1) |", "|---|---|",
                      f"| 1 | {tp['ms_per_token']['1']} |", f"| {w} | {tp['ms_per_token'][w]} |", "",
                      f"Largest logit difference against N = 1: {tp['max_abs_logit_diff']} ({args.dtype}); "
                      f"greedy decoding equal: {tp['greedy_equal']}."]
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.tiny:
        args.reps, args.context, args.new_tokens = min(args.reps, 3), min(args.context, 32), min(args.new_tokens, 8)
    if torch.device(args.device).type == "cuda" and not torch.cuda.is_available():
        print("gpu_check: no CUDA GPU visible to torch; nothing measured", file=sys.stderr)
        return 2
    model = random_target(args)
    report = {"model": "tiny random llama" if args.tiny else "random-weight Llama-3-8B shape (32 layers, d 4096, GQA 8)",
              "device": torch.cuda.get_device_name() if model.device.type == "cuda" else "cpu",
              "torch": torch.__version__, "command": "python benchmarks/gpu_check.py " + " ".join(argv or sys.argv[1:])}
    report["step_ms"] = step_times(model, args)
    report["methods"] = methods(model, args)
    del model
    if model_device_is_cuda(args):
        torch.cuda.empty_cache()  # between benchmarks, not on a serving path: make room for the HF copy
    if not args.no_hf:
        report["hf_generate"] = hf_generate(args)
    if not args.no_tp:
        report["tensor_parallel"] = tensor_parallel_check(args)
        if "skipped" in report["tensor_parallel"]:
            print(f"gpu_check: tensor-parallel check skipped: {report['tensor_parallel']['skipped']}", flush=True)
    table = build_table(report, args)
    print(table)
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "timing.json").write_text(json.dumps(report, indent=2) + "\n")
        (args.out / "table.md").write_text(table)
    return 0


def model_device_is_cuda(args) -> bool:
    return torch.device(args.device).type == "cuda"


if __name__ == "__main__":
    sys.exit(main())
