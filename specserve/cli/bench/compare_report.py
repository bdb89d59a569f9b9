"""make compare's report (benchmarks/compare.py): one Markdown table and one plot from its JSON."""

from __future__ import annotations

from pathlib import Path


def _f(x, spec: str = ".1f") -> str:
    return "–" if x is None else format(x, spec)


def _mib(n) -> str:
    return "–" if n is None else f"{n / 2**20:.2f}"


def _drafted(row: dict) -> str:
    # Both come from the same step count: one is None exactly when the other is.
    per_step, share = row.get("draft_tokens_per_step"), row.get("drafting_step_share")
    return "–" if per_step is None else f"{per_step:.2f} ({share:.0%})"


def markdown(report: dict) -> str:
    s, p, bw = report["settings"], report["prompts"], report["machine"]["memory_bandwidth"]
    sets = ", ".join(f"{n} {k}" for k, n in p["by_set"].items() if n)
    lines = [
        f"# make compare: {report['target']}", "",
        f"`{report['command']}`", "",
        f"{p['count']} held-out prompts ({sets}; the JSON lists them), {s['new_tokens']} new tokens at most, "
        f"{s['threads']} thread(s) on {report['machine']['cpu']}; measured memory bandwidth "
        f"{bw['bytes_per_s'] / 1e9:.2f} GB/s (copy loop). Ran {report['wall_s'] / 60:.1f} min.", "",
        "× none: ÷ `none` of the same configuration, temperature and concurrency in the same pass (peers: fp32 "
        "`none` at c = 1; a peer rerun in pass 2 has none). × llama.cpp: ÷ the plain llama.cpp row of the same "
        "pass and temperature, c = 1 (pass 2 reruns it beside the quantized configurations). "
        "% bound: tokens/s ÷ (bandwidth ÷ weight bytes per step), c = 1 only. "
        "text = none: greedy rows, share of prompts whose text equals `none`'s. drafted/step: draft tokens per "
        "decode step (in brackets: the share of steps that drafted at all; the adaptive policy drafts nothing "
        "where it expects no gain). draft / verify ms/step: the server's own split of a step's wall time "
        "(at c > 1 a batch step's, charged to each of its rows).", "",
        "| system | T | c | tokens/s | × none | × llama.cpp | acc. len | drafted/step | draft / verify ms/step "
        "| TTFT p50 ms | TPOT p50 / p99 ms | ITL std ms | draft MiB/seq | weights MiB/step | % bound | text = none |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---|---:|---|---:|---:|---:|---:|---:|",
    ]
    for r in sorted(report["rows"], key=lambda r: (r["temperature"], r["concurrency"], r["config"] is None,
                                                   r["config"] or "", r["system"])):
        frac = r.get("bandwidth_bound_fraction")
        same = r.get("text_equals_none")
        lines.append(
            f"| {r['system']} | {r['temperature']:g} | {r['concurrency']} | {_f(r['tokens_per_s'])} | "
            f"{_f(r['x_none'], '.2f')} | {_f(r.get('x_llama_cpp'), '.2f')} | "
            f"{_f(r['acceptance_length'], '.2f')} | {_drafted(r)} | "
            f"{_f(r.get('draft_ms_per_step'))} / {_f(r.get('verify_ms_per_step'))} | {_f(r['ttft_p50_ms'], '.0f')} | "
            f"{_f(r['tpot_p50_ms'])} / {_f(r['tpot_p99_ms'])} | {_f(r['itl_std_ms'])} | "
            f"{_mib(r.get('draft_memory_bytes'))} | {_mib(r.get('weight_bytes_per_step'))} | "
            f"{'–' if frac is None else f'{100 * frac:.0f} %'} | {'–' if same is None else f'{same:.0%}'} |")
    for sk in report["skipped"]:
        lines.append(f"| {sk['system']} | | | not run: {sk['reason']} | | | | | | | | | | | | |")
    lines += ["", f"Best speculative method (fp32, c = 1, greedy): {report['methods']['best'] or 'none ran'}.", "",
              "Checks: " + ("all passed" if not report["failures"] else "FAILED"), ""]
    lines += [f"- {c}" for c in report["checks"]] + [f"- FAILED: {f}" for f in report["failures"]]
    return "\n".join(lines) + "\n"


def plot(report: dict, path: Path) -> None:
    """tokens/s per system, one panel per (temperature, concurrency)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels = sorted({(r["temperature"], r["concurrency"]) for r in report["rows"]})
    fig, axes = plt.subplots(1, len(panels), figsize=(5 * len(panels), 0.35 * len(report["rows"]) + 2), squeeze=False)
    for ax, (t, c) in zip(axes[0], panels):
        rows = sorted((r for r in report["rows"] if (r["temperature"], r["concurrency"]) == (t, c)),
                      key=lambda r: r["tokens_per_s"] or 0)
        ax.barh([r["system"] for r in rows], [r["tokens_per_s"] or 0 for r in rows],
                color=["tab:orange" if r["config"] is None else "tab:blue" for r in rows])
        ax.set_title(f"T = {t:g}, c = {c}")
        ax.set_xlabel("output tokens / s")
    fig.suptitle(f"make compare: {report['target']} ({report['prompts']['count']} held-out prompts; "
                 "blue specserve, orange peers)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
