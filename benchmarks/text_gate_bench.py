"""Latency of the text-type gate per request, in one run (hold the bench lock):

    flock /tmp/specserve-bench.lock python benchmarks/text_gate_bench.py [--rounds 5] [--out F.json]

1. In process: `TextClassifier.classify` on each prompt (the 40 held-out demo prompts and the
   400 texts of the classifier's held-out sample), split into the feature function (numpy) and
   the ONNX forward (onnxruntime, one thread).
2. Through Triton (the demo target, text_classifier served, nothing else gated): the `preprocess`
   model called directly, per prompt alternately with spec_method "dflash" (the gate runs: a BLS
   call to text_classifier, then the rewrite) and "none" (no gate), so the difference of the two
   is what the gate adds to a request, BLS round trip included, measured side by side. Also a
   client's direct gRPC call to text_classifier (a network round trip on top of what BLS pays).

Medians and 90th percentiles in milliseconds.
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parents[1]
CLASSIFIER = REPO / "models" / "demo" / "text_classifier"
TARGET = REPO / "models" / "demo" / "target"


def stats(seconds: list[float]) -> dict:
    ms = np.array(seconds) * 1e3
    return {"n": len(ms), "median_ms": round(float(np.median(ms)), 3), "p90_ms": round(float(np.percentile(ms, 90)), 3)}


def prompts() -> list[str]:
    demo = [json.loads(ln)["prompt"] for ln in (REPO / "models/demo/heldout_prompts.jsonl").read_text().splitlines()]
    sample = [json.loads(ln)["text"] for ln in (CLASSIFIER / "heldout_sample.jsonl").read_text().splitlines()]
    return demo + sample


def in_process(texts: list[str], rounds: int) -> dict:
    from specserve.serving.text_classifier import TextClassifier, features

    clf = TextClassifier(CLASSIFIER)
    feat, onnx, total = [], [], []
    for _ in range(rounds):
        for t in texts:
            t0 = time.perf_counter()
            x = features(t, clf.cfg.features)[None]
            t1 = time.perf_counter()
            clf.session.run([clf.cfg.output_name], {clf.cfg.input_name: x})
            t2 = time.perf_counter()
            clf.classify(t)
            t3 = time.perf_counter()
            feat.append(t1 - t0)
            onnx.append(t2 - t1)
            total.append(t3 - t2)
    return {"features": stats(feat), "onnx": stats(onnx), "classify": stats(total),
            "mean_prompt_chars": round(float(np.mean([len(t) for t in texts])), 1)}


def through_triton(texts: list[str], rounds: int) -> dict:
    import tritonclient.grpc as grpcclient

    from specserve.cli.main import SERVE_TRITON_ARGS
    from specserve.serving import schema
    from specserve.triton.client import build_inputs
    from specserve.triton.launch import TritonServer
    from specserve.serving.params import RequestConfig
    from specserve.serving.settings import DeploymentSettings
    from specserve.triton.render import render_repository

    root = Path(tempfile.mkdtemp(prefix="specserve-text-gate-bench-"))
    repo = render_repository(DeploymentSettings(TARGET, max_num_seqs=2, max_model_len=1024, default_method="none",
                                                text_classifier=str(CLASSIFIER), draft_policy="fixed"),
                                                root / "model_repository")
    srv = TritonServer(repo, root, None, log_file=root / "tritonserver.log", exit_timeout_s=5,
                       extra_args=list(SERVE_TRITON_ARGS))
    srv.start()
    try:
        srv.wait_ready(300)
        client = grpcclient.InferenceServerClient(srv.grpc_url)
        out = [grpcclient.InferRequestedOutput(schema.REQUEST_CONFIG.name)]
        timed: dict[str, list[float]] = {"preprocess_gated": [], "preprocess_plain": [], "text_classifier_grpc": []}
        routed = {}

        def call_pre(text, method):
            t0 = time.perf_counter()
            r = client.infer(schema.PREPROCESS.name, build_inputs(text, {"spec_method": method}), outputs=out)
            dt = time.perf_counter() - t0
            return dt, RequestConfig.from_json(r.as_numpy(schema.REQUEST_CONFIG.name).reshape(-1)[0])

        def call_clf(text):
            arr = np.array([text.encode()], dtype=np.object_)
            inp = grpcclient.InferInput(schema.GATE_TEXT.name, [1], "BYTES")
            inp.set_data_from_numpy(arr)
            t0 = time.perf_counter()
            client.infer(schema.TEXT_CLASSIFIER.name, [inp])
            return time.perf_counter() - t0

        for t in texts[:20]:   # warm-up
            call_pre(t, "dflash"), call_pre(t, "none"), call_clf(t)
        for r in range(rounds):
            for i, t in enumerate(texts):
                order = ("dflash", "none") if (i + r) % 2 == 0 else ("none", "dflash")
                for method in order:
                    dt, config = call_pre(t, method)
                    timed["preprocess_gated" if method == "dflash" else "preprocess_plain"].append(dt)
                    if method == "dflash":
                        routed[config.text_gate["decision"]] = routed.get(config.text_gate["decision"], 0) + 1
                timed["text_classifier_grpc"].append(call_clf(t))
        result = {k: stats(v) for k, v in timed.items()}
        gated, plain = np.array(timed["preprocess_gated"]), np.array(timed["preprocess_plain"])
        result["gate_adds_median_ms"] = round(float(np.median(gated - plain)) * 1e3, 3)
        result["decisions"] = routed
        return result
    finally:
        srv.stop()


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args(argv)
    texts = prompts()
    report = {"command": "flock /tmp/specserve-bench.lock python benchmarks/text_gate_bench.py "
                         f"--rounds {args.rounds}" + (f" --out {args.out}" if args.out else ""),
              "prompts": len(texts), "rounds": args.rounds,
              "in_process": in_process(texts, args.rounds), "triton": through_triton(texts, args.rounds)}
    text = json.dumps(report, indent=1)
    print(text)
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(text + "\n")


if __name__ == "__main__":
    main()
