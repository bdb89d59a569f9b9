"""The benchmark report: bench.json (every figure and the machine), bench.md (tables) and plots.

Every number here comes from the run's records; nothing is typed in. A method the server does not
offer appears under `methods.skipped` with the server's reason, never as a zero.
"""

from __future__ import annotations

import json
import os
import platform
import sys
from pathlib import Path

from specserve.cli.bench import metrics
from specserve.cli.bench.runner import PhaseResult

SCHEMA = "specserve-bench/1"


def machine() -> dict:
    import torch

    cpu = platform.processor() or ""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    try:
        affinity = len(os.sched_getaffinity(0))
    except AttributeError:
        affinity = os.cpu_count()
    return {"cpu_model": cpu, "logical_cores": os.cpu_count(), "usable_cores": affinity,
            "load_average_1m": os.getloadavg()[0],
            "platform": platform.platform(), "python": sys.version.split()[0], "torch": torch.__version__,
            "cuda": torch.cuda.get_device_name(0) if torch.cuda.is_available() else None}


def phase_summary(phase: PhaseResult) -> dict:
    methods = {m: metrics.summarize(phase.records[m], phase.windows[m]) for m in phase.records}
    none = methods.get("none")
    ref = phase.records.get("none")
    return {"name": phase.name, "mode": phase.mode, "concurrency": phase.concurrency,
            "request_rate": phase.request_rate, "block_order": phase.order, "methods": methods,
            "speedup_vs_none": {m: metrics.speedup(s, none) for m, s in methods.items()} if none else {},
            "identical_outputs_vs_none": {m: metrics.identical_outputs(phase.records[m], ref)
                                          for m in phase.records} if ref else {}}


def write_json(report: dict, out: Path) -> Path:
    path = out / "bench.json"
    path.write_text(json.dumps(report, indent=2, allow_nan=False) + "\n")
    return path


# -- Markdown --------------------------------------------------------------------------------------
def _f(x, scale: float = 1.0, digits: int = 1) -> str:
    return "—" if x is None else f"{x * scale:.{digits}f}"


def _pct(x) -> str:
    return "—" if x is None else f"{100 * x:.0f} %"


def _d(dist: dict | None, stat: str, scale: float = 1.0, digits: int = 1) -> str:
    return _f(None if dist is None else dist[stat], scale, digits)


def markdown(report: dict) -> str:
    m, model, wl = report["machine"], report["model"], report["workload"]
    lines = [f"# specserve bench — {report['created_utc']}", "",
             f"- model: `{model['path']}` ({model['kind']}), served by tritonserver as ensemble "
             f"`{report['server']['model']}`, max_model_len {model['max_model_len']}",
             f"- machine: {m['cpu_model']}, {m['usable_cores']} cores usable, torch {m['torch']}"
             + (f", {m['cuda']}" if m.get("cuda") else " (CPU)")
             + f"; load average {m['load_average_1m']:.1f} at the start, {m['load_average_1m_end']:.1f} at the end",
             f"- workload: {wl['num_requests']} requests, seed {wl['seed']}, outputs drawn from "
             f"{wl['output_range'][0]}–{wl['output_range'][1]} tokens; prompt mix "
             + ", ".join(f"{k} {b['count']}" + (f" ({b['prompt_tokens_min']}–{b['prompt_tokens_max']} tok"
                                                  + (", capped by the model length" if b["capped"] else "") + ")"
                                                  if b["count"] else "")
                         for k, b in wl["buckets"].items()),
             f"- command: `{report['command']}`"]
    if report["methods"]["skipped"]:
        lines.append("- skipped methods: " + "; ".join(f"`{k}`: {v}" for k, v in report["methods"]["skipped"].items()))
    lines += ["", "| phase | method | out tok/s | × none | req/s | TTFT P50 ms | TPOT P50 ms | ITL P50 ms "
              "| E2E P50 s | E2E P90 s | E2E P99 s | E2E std s | acc. len | draft tok/step | same text as none | errors |",
              "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for ph in report["phases"]:
        label = f"C={ph['concurrency']}" if ph["mode"] == "closed" else f"λ={ph['request_rate']:g}/s"
        for name, s in ph["methods"].items():
            x = ph["speedup_vs_none"].get(name, {}).get("output_throughput")
            lines.append(
                f"| {label} | {name} | {_f(s['output_throughput'])} | {_f(x, digits=2)} | "
                f"{_f(s['request_throughput'], digits=3)} | {_d(s['ttft_s'], 'p50', 1e3)} | "
                f"{_d(s['tpot_s'], 'p50', 1e3)} | {_d(s['itl_s'], 'p50', 1e3)} | {_d(s['e2e_s'], 'p50', 1, 2)} | "
                f"{_d(s['e2e_s'], 'p90', 1, 2)} | {_d(s['e2e_s'], 'p99', 1, 2)} | {_d(s['e2e_s'], 'std', 1, 2)} | "
                f"{_f(s['mean_acceptance_length'], digits=2)} | {_f(s['draft_tokens_per_step'], digits=2)} | "
                f"{_pct(ph['identical_outputs_vs_none'].get(name))} | {s['errors']} |")
    peers = report["peers"]
    lines.append("")
    if peers["status"] != "run":
        lines.append(f"Peers: not run — {peers['reason']}")
    else:
        lines += [f"Peers (concurrency 1, {peers['num_requests']} requests, same prompts; specserve best = "
                  f"`{peers['specserve_best']}`):", "",
                  "| system | out tok/s | ÷ specserve none | ÷ specserve best | same text as specserve none |",
                  "|---|---|---|---|---|"]
        for name, s in peers["systems"].items():
            if s["status"] != "run":
                lines.append(f"| {name} | not run: {s['reason']} | | | |")
                continue
            lines.append(f"| {name} | {_f(s['output_throughput'])} | {_f(s['ratio_to_specserve_none'], digits=2)} | "
                         f"{_f(s['ratio_to_specserve_best'], digits=2)} | "
                         f"{_pct(s['identical_text_to_specserve_none'])} |")
    for note in report.get("notes", []):
        lines.append(f"\n_{note}_")
    return "\n".join(lines) + "\n"


# -- plots -----------------------------------------------------------------------------------------
def plots(report: dict, phases: list[PhaseResult], out: Path) -> list[Path]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    written = []
    # 1. Latency CDFs per method (E2E and TPOT) in the first closed-loop phase.
    closed = next((p for p in phases if p.mode == "closed"), phases[0])
    fig, axes = plt.subplots(1, 3, figsize=(14, 4))
    for ax, (title, fn) in zip(axes, (("TTFT (s)", metrics.ttft), ("TPOT (s)", metrics.tpot),
                                      ("E2E latency (s)", metrics.e2e))):
        for method, recs in closed.records.items():
            xs = sorted(v for v in (fn(r) for r in recs) if v is not None)
            if xs:
                ax.step(xs, [(i + 1) / len(xs) for i in range(len(xs))], where="post", label=method)
        ax.set_xlabel(title)
        ax.set_ylabel("fraction of requests")
        ax.grid(alpha=0.3)
        ax.legend()
    fig.suptitle(f"Latency CDF per method — {closed.name}")
    fig.tight_layout()
    written.append(out / "latency_cdf.png")
    fig.savefig(written[-1], dpi=110)
    plt.close(fig)

    # 2. Output throughput vs offered request rate (open-loop phases).
    open_phases = [p for p in report["phases"] if p["mode"] == "open"]
    fig, ax = plt.subplots(figsize=(6, 4))
    for method in report["methods"]["run"]:
        pts = sorted((p["request_rate"], p["methods"][method]["output_throughput"]) for p in open_phases
                     if p["methods"].get(method, {}).get("output_throughput") is not None)
        if pts:
            ax.plot([a for a, _ in pts], [b for _, b in pts], marker="o", label=method)
    ax.set_xlim(left=0)
    ax.set_ylim(bottom=0)
    ax.set_xlabel("offered request rate (requests/s, Poisson)")
    ax.set_ylabel("output tokens/s")
    ax.set_title("Throughput vs request rate")
    ax.grid(alpha=0.3)
    if open_phases:
        ax.legend()
    else:
        ax.text(0.5, 0.5, "no open-loop phase in this run", ha="center", transform=ax.transAxes)
    fig.tight_layout()
    written.append(out / "throughput_vs_rate.png")
    fig.savefig(written[-1], dpi=110)
    plt.close(fig)

    # 3. Speedup bars: output throughput ÷ none per phase and method, and the peers' ratios.
    bars = [(f"{p['name']}\n{m}", s["output_throughput"]) for p in report["phases"]
            for m, s in p["speedup_vs_none"].items() if m != "none" and s["output_throughput"] is not None]
    if report["peers"]["status"] == "run":
        bars += [(f"peers\n{n}", s["ratio_to_specserve_none"]) for n, s in report["peers"]["systems"].items()
                 if s["status"] == "run" and n != "specserve_none" and s["ratio_to_specserve_none"] is not None]
    fig, ax = plt.subplots(figsize=(max(6, 1.1 * len(bars) + 2), 4))
    ax.bar(range(len(bars)), [b for _, b in bars], color="tab:blue")
    ax.axhline(1.0, color="k", lw=0.8, ls="--")
    ax.set_xticks(range(len(bars)), [a for a, _ in bars], fontsize=7)
    ax.set_ylabel("output tokens/s ÷ specserve none (same run)")
    ax.set_title("Speedup over plain decoding")
    fig.tight_layout()
    written.append(out / "speedup.png")
    fig.savefig(written[-1], dpi=110)
    plt.close(fig)
    return written
