"""Loss curve (and teacher-forced top-1 agreement) PNG from a drafter's train_log.jsonl.

    python training/plot_train_log.py models/demo/mtp/train_log.jsonl models/demo/mtp/training_curve.png
    python training/plot_train_log.py models/demo/draft/train_log.jsonl models/demo/draft/training_curve.png

Handles the three logs: train_mtp.py (loss, top1_per_head), train_draft.py (loss, top1) and
train_eagle3.py (ce, top1 per unrolled step: the training-time-test steps). Curves are
smoothed with a 25-step moving average (single steps see a few hundred positions).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path


def smooth(xs: list[float], w: int = 25) -> list[float]:
    out, acc = [], 0.0
    for i, x in enumerate(xs):
        acc += x - (xs[i - w] if i >= w else 0.0)
        out.append(acc / min(i + 1, w))
    return out


def main(argv: list[str] | None = None) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    log, png = map(Path, (argv or sys.argv[1:])[:2])
    rows = [json.loads(x) for x in log.read_text().splitlines()]
    steps = [r["step"] for r in rows]
    fig, (a, b) = plt.subplots(1, 2, figsize=(10, 3.6))
    eagle3 = "ce" in rows[0]
    a.plot(steps, smooth([r["ce" if eagle3 else "loss"] for r in rows]))
    summed = " (sum over heads)" if "top1_per_head" in rows[0] else ""
    a.set(xlabel="step", ylabel=("soft CE, 0.8^k-weighted sum over unrolled steps" if eagle3 else
                                 "soft CE vs the target's top-K" + summed), title=log.parent.name)
    if eagle3:
        val = [r for r in rows if "val_top1" in r]   # --val-every: the validation split, unsmoothed
        if val:
            a.plot([r["step"] for r in val], [r["val_ce"] for r in val], "o--", label="validation split")
            a.legend()
        for k in range(len(rows[0]["top1"])):
            line, = b.plot(steps, smooth([r["top1"][k] for r in rows]), label=f"unrolled step {k} (token t+{k + 2})")
            if val:
                b.plot([r["step"] for r in val], [r["val_top1"][k] for r in val], "o--", color=line.get_color(),
                       label=f"step {k}, validation split")
        b.legend()
    elif "top1_per_head" in rows[0]:
        for j in range(len(rows[0]["top1_per_head"])):
            b.plot(steps, smooth([r["top1_per_head"][j] for r in rows]), label=f"head {j} (token t+{j + 2})")
        b.legend()
    else:
        b.plot(steps, smooth([r["top1"] for r in rows]))
    b.set(xlabel="step", ylabel="top-1 agreement with the target (train batch)")
    fig.tight_layout()
    fig.savefig(png, dpi=90)


if __name__ == "__main__":
    main()
