"""Per-call cost of remote mtp's two drafter models, in process (what their model.py runs, without
Triton's transport): mtp_heads (the demo heads' ONNX export under onnxruntime, one thread) and
draft_drafter (the demo draft model's service, torch, one thread, fp32 as rendered with
--drafter-dtype float32 and as `auto` where the CPU has fast bf16).

A draft_drafter call in steady state: each row's context grew by 3 tokens since its last call
(2 accepted drafts + the bonus token), so it catches up 3 tokens and drafts 8. An mtp_heads call
reads one feature row per sequence and drafts each head's top-1 (4 heads).

    flock /tmp/specserve-bench.lock .venv/bin/python benchmarks/mtp_remote_models.py
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

ROOT = Path(__file__).resolve().parents[1]
DEMO = ROOT / "models" / "demo"


def median_ms(fn, n: int, warmup: int = 3) -> float:
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(n):
        t = time.perf_counter()
        fn()
        times.append((time.perf_counter() - t) * 1e3)
    return round(statistics.median(times), 2)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--calls", type=int, default=30)
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args()
    torch.set_num_threads(1)

    from specserve.model.transformer import load_model
    from specserve.methods.mtp.heads import export_mtp_onnx, load_mtp_heads
    from specserve.methods.mtp.heads_onnx_runtime import HeadsOnnxRuntime
    from specserve.methods.mtp.remote_drafters import DraftModelService, load_remote_draft

    target = load_model(DEMO / "target")
    heads = load_mtp_heads(DEMO / "mtp", target)
    out = Path(tempfile.mkdtemp(prefix="mtp-remote-bench-"))
    export_mtp_onnx(heads, out / "mtp_heads.onnx")
    rt = HeadsOnnxRuntime(out / "mtp_heads.onnx")
    from specserve.model.tokenizer import load_tokenizer

    # Real text as contexts: the held-out prompts' tokens, one long run, a different offset per row.
    tok = load_tokenizer(DEMO / "target")
    text = [json.loads(line)["prompt"] for line in (DEMO / "heldout_prompts.jsonl").read_text().splitlines()]
    ids_all = [t for p in text for t in tok.encode(p).ids]
    rows = [ids_all[40 * b: 40 * b + 64 + 3 * (args.calls + 10)] for b in range(4)]
    D = target.cfg.hidden_size
    report = {}
    for B in (1, 4):
        feats = np.random.default_rng(0).standard_normal((B, 3, D)).astype(np.float32)
        report[f"mtp_heads_B{B}_ms"] = median_ms(lambda: rt.chains(feats, np.full(B, 3), np.full(B, 8)), args.calls)
    for dtype in ("float32", "auto"):
        draft = load_remote_draft(DEMO / "draft", DEMO / "target", dtype=dtype)
        for B in (1, 4):
            service = DraftModelService(draft, max_num_seqs=8, max_model_len=2048, max_draft_len=8)
            ids = np.arange(B)
            length = [64]

            def step():
                L = length[0]
                ctx = np.array([r[:L] for r in rows[:B]], dtype=np.int64)
                service.chains(ids, ctx, np.full(B, 8))
                length[0] = L + 3   # 3 new tokens per step
            service.chains(ids, np.array([r[:61] for r in rows[:B]], dtype=np.int64), np.full(B, 8))
            report[f"draft_drafter_{dtype}_B{B}_ms"] = median_ms(step, args.calls)
    report["command"] = "flock /tmp/specserve-bench.lock .venv/bin/python benchmarks/mtp_remote_models.py"
    print(json.dumps(report, indent=2))
    if args.out:
        args.out.write_text(json.dumps(report, indent=2) + "\n")


if __name__ == "__main__":
    main()
