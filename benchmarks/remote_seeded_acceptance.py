"""Remote EAGLE on seeded requests: acceptance length of the remote drafter (the exported ONNX
backbone and calibration head, as eagle_proposal runs them) proposing with the rows' noise,
against the fused drafter and against the same remote drafter sent no row sampling (greedy
drafts for seeded rows, as before remote drafters got the seed), on the demo model.

    python benchmarks/remote_seeded_acceptance.py [--prompts 3] [--new-tokens 48] [--seeds 2] [--out F.json]

In process (the remote drafter through RemoteProposer over onnx_runtime.in_process_call, no
server), float32 target, the held-out prompts of models/demo/heldout_prompts.jsonl (code and
prose alternated), max_draft_len 8, spec_threshold 0.3, fixed draft policy, `ignore_eos`;
all requests of one (drafter, temperature) in one batch. Every output is checked against
`none`'s for its seed. Seeded, so the numbers are the same every run.
Acceptance length = (accepted + steps) / steps over all requests.
"""

from __future__ import annotations

import platform
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))
from serving_phases import DEMO, alternated_prompts  # noqa: E402

TEMPERATURES = (0.7, 1.0)
DRAFTERS = ("fused", "remote", "remote_greedy")


def proposers(target, max_num_seqs: int, tmp: Path) -> dict:
    from specserve.methods.eagle.drafter import load_eagle
    from specserve.methods.eagle.export import export
    from specserve.methods.eagle.onnx_runtime import CalibrationOnnxRuntime, EagleOnnxRuntime, in_process_call
    from specserve.methods.eagle.proposer import EagleProposer
    from specserve.methods.remote import RemoteProposer

    drafter = load_eagle(DEMO / "eagle", target)
    report = export(target, drafter, tmp)
    c = target.cfg

    def call():
        return in_process_call(EagleOnnxRuntime(str(report.backbone), c.num_kv_heads, c.head_dim),
                               CalibrationOnnxRuntime(str(report.calibration)))

    greedy = call()
    return {"fused": EagleProposer(drafter, target, max_num_seqs=max_num_seqs, max_model_len=512, max_draft_len=8,
                                   threshold=0.3, name="fused"),
            "remote": RemoteProposer("remote", call(), max_draft_len=8, threshold=0.3, timeout_s=600),
            # the row sampling dropped: what a drafter that ignores the seed drafts
            "remote_greedy": RemoteProposer("remote_greedy", lambda x: greedy({k: v for k, v in x.items()
                                                                               if not k.startswith("row_")}),
                                            max_draft_len=8, threshold=0.3, timeout_s=600)}


def run(args, log=print) -> dict:
    import torch

    from specserve.core.engine import Engine, EngineConfig, GenerationRequest
    from specserve.core.sampling import SamplingParams
    from specserve.model.tokenizer import load_tokenizer
    from specserve.model.transformer import load_model

    torch.set_num_threads(args.threads)
    target = load_model(DEMO / "target")
    tok = load_tokenizer(DEMO / "target")
    ids = [tok.encode(p["prompt"]).ids for p in alternated_prompts(args.prompts)]
    n = len(ids) * args.seeds
    with tempfile.TemporaryDirectory() as tmp:
        engine = Engine(target, EngineConfig(max_num_seqs=n, max_model_len=512, max_draft_len=8, draft_policy="fixed"),
                        proposers(target, n, Path(tmp)), eos_token_ids=())

        def batch(method: str, temperature: float) -> dict:
            return engine.generate([
                GenerationRequest(f"{method}-{i}-{s}", p, SamplingParams(max_tokens=args.new_tokens, temperature=temperature,
                                                                          ignore_eos=True, seed=1 + s + args.seeds * i), method)
                for i, p in enumerate(ids) for s in range(args.seeds)])

        results: dict = {}
        for T in TEMPERATURES:
            plain = batch("none", T)
            for m in DRAFTERS:
                out = batch(m, T)
                steps = sum(o.stats.steps for o in out.values())
                accepted = sum(o.stats.accepted_tokens for o in out.values())
                row = {"acceptance_length": round((accepted + steps) / steps, 3), "steps": steps,
                       "draft_tokens": sum(o.stats.draft_tokens for o in out.values()), "accepted_tokens": accepted,
                       "equals_none": all(o.new_token_ids == plain[rid.replace(m, "none", 1)].new_token_ids
                                          for rid, o in out.items())}
                results.setdefault(f"T={T}", {})[m] = row
                log(f"T={T} {m}: {row['acceptance_length']} (equals none: {row['equals_none']})")
    return {"results": results,
            "setup": {"prompts": f"{len(ids)} held-out prompts (models/demo/heldout_prompts.jsonl, code and prose "
                                 "alternated)", "seeds_per_prompt": args.seeds, "new_tokens": args.new_tokens,
                      "max_draft_len": 8, "spec_threshold": 0.3, "draft_policy": "fixed", "target_dtype": "float32",
                      "device": "cpu", "machine": platform.processor() or platform.machine(), "threads": args.threads},
            "command": " ".join(["python", "benchmarks/remote_seeded_acceptance.py", *sys.argv[1:]])}


def main() -> None:
    from seeded_acceptance import main as acceptance_main   # the same command line and report file

    acceptance_main(__doc__, run, ROOT / "docs" / "sampling" / "remote_eagle.json")


if __name__ == "__main__":
    main()
