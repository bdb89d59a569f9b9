"""Build the engine a deployment serves: model, tokenizer and the method → proposer wiring.

The one place that says which speculation methods exist; new proposers (MTP, DFlash, DSPark)
are added to PROPOSERS (no trained weights needed) or DRAFTED (built from a drafter folder).
Shared by the target_verifier model, the CLI and benchmarks.

EAGLE has two placements behind the same proposer interface: "fused" (the drafter runs in the
engine process, torch) and "remote" (the exported ONNX drafter runs in the Triton models of the
`eagle_proposal` ensemble, called once per step by BLS, hot-loadable).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Callable

from specserve.model.tokenizer import load_tokenizer, make_decode
from specserve.serving import fault_injection

log = logging.getLogger("specserve.factory")

if TYPE_CHECKING:
    from specserve.core.proposer import Proposer


def _ngram() -> "Proposer":
    from specserve.methods.ngram.proposer import NgramProposer
    return NgramProposer()


# "none" (plain decoding) is built into the engine.
PROPOSERS: dict[str, Callable[[], "Proposer"]] = {
    "ngram": _ngram,
}

# Methods that need a trained drafter (given per deployment in EngineSettings.drafters).
DRAFTED = ("eagle", "dflash", "draft")
# Drafted methods that run in the engine's process in either placement (the remote placement
# moves the others out): DFlash keeps its per-sequence memory beside the engine's features;
# "draft" is a separate small LM with its own KV cache (specserve.methods.draft.proposer). As a
# method of its own neither has a remote model; inside remote `mtp` the draft model (and the MTP
# heads) run as the Triton models draft_drafter / mtp_heads (remote_mtp.py).
FUSED_ONLY = ("dflash", "draft")
# Methods whose rows step aside to a fallback method while their output repeats (the request's
# spec_fallback, its tier's fallback, else EngineConfig.guard_fallback): never a fallback themselves.
GUARDED = ("dflash",)
# Methods built from another method's drafter: dspark runs the served EAGLE drafter fused, as one
# static step (specserve.methods.dspark.proposer), whichever placement EAGLE itself uses.
STATIC_METHODS = {"dspark": "eagle"}
# The method the text-type gate (specserve/serving/text_gate.py) acts on: a request whose effective method
# is this one runs it only when its prompt's text type is configured to (else its fallback).
GATED_METHOD = "dflash"
# Composite methods, built from the other served proposers: `mtp` (specserve.methods.mtp.proposer)
# merges the drafts of every served sub-proposer in one tree; served as soon as one trained
# sub-proposer is. Its own drafter folder (`--drafter mtp=DIR`, optional) holds the MTP heads.
# Sub-proposer → the method whose drafter it is (None: needs none).
COMPOSITE_METHODS = ("mtp",)
MTP_SUBPROPOSERS = {"mtp_heads": "mtp", "eagle": "eagle", "draft": "draft", "ngram": None}
PLACEMENTS = ("fused", "remote")
DTYPES = ("float32", "bfloat16")
DRAFTER_DTYPES = ("auto", *DTYPES)


def resolve_drafter_dtype(name: str, model) -> "torch.dtype":
    import torch

    if name == "auto":
        fast_bf16 = model.device.type == "cuda" or torch.ops.mkldnn._is_mkldnn_bf16_supported()
        return torch.bfloat16 if fast_bf16 else model.dtype
    if name not in DRAFTER_DTYPES:
        raise ValueError(f"drafter dtype must be auto or one of {', '.join(DTYPES)}, got {name!r}")
    return getattr(torch, name)


@dataclass(frozen=True)
class EngineSettings:
    checkpoint: Path
    max_num_seqs: int = 16
    max_model_len: int | None = None     # None → min(the model's max_position_embeddings, 2048)
    max_draft_len: int = 8
    default_method: str = "none"
    drafters: tuple[tuple[str, str], ...] = ()  # (method, drafter folder), e.g. ("eagle", "models/demo/eagle")
    placement: str = "fused"                    # where EAGLE's drafter runs: "fused" or "remote"
    # Where mtp's drafters run: "remote": the mtp_proposal ensemble, every drafter a Triton model of
    # its own, in parallel; it needs a served EAGLE drafter (the ensemble's EAGLE models), else mtp
    # runs fused (mtp_runs_remote). "fused": one after another in the engine. Served deployments
    # default to remote (RepositorySettings, `serve --mtp-placement`); an engine built in process,
    # with no Triton to call, defaults to fused.
    mtp_placement: str = "fused"
    spec_threshold: float | None = 0.3          # calibration-head stop threshold (None: fixed length)
    # Compute dtype of the target. float32 is exact: spec output equals plain
    # decoding token for token. bfloat16 is faster on CPUs with bf16 matmuls (demo model through
    # Triton: a 5.5-token verify 13.2 vs 19.7 ms, a plain step 12.5 vs 15.3 ms), but
    # its kernels round differently for a 1-token step and a K+1-token verify, so outputs may
    # part at near-ties (each is the target's greedy output up to bf16 rounding).
    dtype: str = "float32"
    # Compute dtype of fused drafters: "auto" = bfloat16 where the hardware has bf16 matmuls
    # (CUDA, or a CPU with oneDNN bf16 support), else the target's. Never affects the output,
    # which the target verifies; measured on the demo model: drafting 12.9 → 7.9 ms per step,
    # acceptance length 4.11 → 4.15. Remote drafters run their exported fp32 ONNX models.
    drafter_dtype: str = "auto"
    # Where the target, its KV pool, fused drafters and the static step's state live:
    # auto (CUDA when available), cpu, cuda or cuda:N.
    device: str = "auto"
    max_queue_len: int = 128   # requests waiting for a slot, at most (EngineConfig.max_queue_len)
    draft_policy: str = "fixed"  # EngineConfig.draft_policy
    # DFlash block size (drafts up to block_size - 1 per step, and at most max_draft_len);
    # None → the drafter's config.json
    block_size: int | None = None


def static_methods(drafters: tuple[tuple[str, str], ...]) -> list[str]:
    served = {m for m, _ in drafters}
    return [m for m, base in STATIC_METHODS.items() if base in served]


def composite_methods(drafters: tuple[tuple[str, str], ...]) -> list[str]:
    served = {m for m, _ in drafters}
    trained = {m for m in MTP_SUBPROPOSERS.values() if m}
    return ["mtp"] if served & trained and "mtp" not in served else []


def mtp_subproposers(drafters: tuple[tuple[str, str], ...]) -> list[str]:
    """The sub-proposers `mtp` merges in a deployment with these drafters (MTP_SUBPROPOSERS order)."""
    served = {m for m, _ in drafters}
    return [sub for sub, m in MTP_SUBPROPOSERS.items() if m is None or m in served]


def mtp_runs_remote(mtp_placement: str, drafters: tuple[tuple[str, str], ...]) -> bool:
    """Whether mtp runs as the mtp_proposal ensemble: its placement is remote, mtp is served, and
    so is an EAGLE drafter (the ensemble's EAGLE models). The renderer and the engine both ask."""
    if mtp_placement not in PLACEMENTS:
        raise ValueError(f"mtp placement must be one of {', '.join(PLACEMENTS)}, got {mtp_placement!r}")
    return mtp_placement == "remote" and "mtp" in served_methods(drafters) and any(m == "eagle" for m, _ in drafters)


def where_drafters_run(drafters: tuple[tuple[str, str], ...], placement: str = "fused",
                       mtp_placement: str = "remote") -> list[str]:
    """One line per served drafter, and one for mtp, saying where it runs (for startup logs)."""
    from specserve.core.paths import shown

    remote_mtp = "mtp" in served_methods(drafters) and mtp_runs_remote(mtp_placement, drafters)
    lines = []
    for method, folder in drafters:
        if method == "mtp":   # the MTP heads run where mtp does
            where = "remote" if remote_mtp else "fused"
        else:
            where = "fused: no remote export" if method in FUSED_ONLY and placement == "remote" else placement
        lines.append(f"drafter {method} from {shown(folder)} ({where})")
    if "mtp" in served_methods(drafters):
        where = ("remote: the mtp_proposal ensemble" if remote_mtp
                 else "fused" + (": remote needs an EAGLE drafter" if mtp_placement == "remote" else ""))
        lines.append(f"mtp merges {', '.join(mtp_subproposers(drafters))} ({where})")
    return lines


def served_methods(drafters: tuple[tuple[str, str], ...]) -> list[str]:
    return ["none", *PROPOSERS, *(m for m, _ in drafters), *static_methods(drafters), *composite_methods(drafters)]


def available_methods(settings: EngineSettings) -> list[str]:
    return served_methods(settings.drafters)


def resolve_device(name: str) -> "torch.device":
    """auto → cuda when a GPU is visible, else cpu; cpu and cuda[:N] as given (checked here)."""
    import torch

    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        device = torch.device(name)
    except RuntimeError:
        raise ValueError(f"device must be auto, cpu or cuda[:N], got {name!r}") from None
    if device.type not in ("cpu", "cuda"):
        raise ValueError(f"device must be auto, cpu or cuda[:N], got {name!r}")
    if device.type == "cuda":
        if not torch.cuda.is_available():
            raise ValueError(f"device {name!r}: this torch build sees no CUDA GPU "
                             f"(torch {torch.__version__}, CUDA {torch.version.cuda})")
        if (device.index or 0) >= torch.cuda.device_count():
            raise ValueError(f"device {name!r}: only {torch.cuda.device_count()} CUDA device(s) visible")
    return device


def _static(method: str, folder: str, model, settings: EngineSettings, max_len: int, base) -> "Proposer":
    from specserve.methods.dspark.proposer import DSParkProposer
    from specserve.methods.eagle.proposer import load_eagle

    # Share the fused EAGLE proposer's drafter weights when there is one.
    drafter = getattr(base, "drafter", None) or load_eagle(
        folder, model, dtype=resolve_drafter_dtype(settings.drafter_dtype, model))
    return DSParkProposer(drafter, model, max_num_seqs=settings.max_num_seqs, max_model_len=max_len,
                          max_draft_len=settings.max_draft_len, threshold=settings.spec_threshold)


def _mtp_heads(folder: str, model, settings: EngineSettings) -> "Proposer":
    try:
        from specserve.methods.mtp.heads import MTPHeadsProposer, load_mtp_heads
    except ImportError as e:
        raise ValueError(f"--drafter mtp={folder}: the MTP heads proposer is not available ({e})") from None
    heads = load_mtp_heads(folder, model, dtype=resolve_drafter_dtype(settings.drafter_dtype, model))
    return MTPHeadsProposer(heads, max_draft_len=settings.max_draft_len)


def _mtp(proposers: dict, folder: str | None, model, settings: EngineSettings) -> "Proposer":
    """The `mtp` method over every served sub-proposer, sharing the served methods' instances.
    Remote placement (settings.mtp_placement, the default) runs it as the mtp_proposal ensemble (all
    of them; remote_mtp.py); a deployment without an EAGLE drafter has no such ensemble, and runs
    mtp fused, as the draft model (said in the log)."""
    from specserve.methods.mtp.proposer import MultiDraftProposer

    if mtp_runs_remote(settings.mtp_placement, settings.drafters):
        from specserve.methods.mtp.remote import remote_mtp
        return remote_mtp(settings, mtp_subproposers(settings.drafters))
    if settings.mtp_placement == "remote":
        log.warning("mtp runs fused: its remote placement needs an EAGLE drafter (mtp_proposal's EAGLE models), "
                    "and none is served")
    subs = [proposers[m] for sub, m in MTP_SUBPROPOSERS.items() if m and sub != "mtp_heads" and m in proposers]
    subs.append(proposers["ngram"])
    if folder:
        subs.append(_mtp_heads(folder, model, settings))
    return MultiDraftProposer(subs, max_draft_len=settings.max_draft_len, vocab_size=model.cfg.vocab_size)


def _drafted(method: str, folder: str, model, settings: EngineSettings, max_len: int) -> "Proposer":
    if method not in DRAFTED:
        raise ValueError(f"unknown drafter method {method!r}; drafters: {', '.join(DRAFTED)}")
    if settings.placement not in PLACEMENTS:
        raise ValueError(f"placement must be one of {', '.join(PLACEMENTS)}, got {settings.placement!r}")
    if method == "dflash":
        from specserve.methods.dflash.proposer import DFlashProposer, load_dflash

        drafter = load_dflash(folder, model, dtype=resolve_drafter_dtype(settings.drafter_dtype, model),
                              block_size=settings.block_size)
        return DFlashProposer(drafter, model, max_num_seqs=settings.max_num_seqs, name=method,
                              threshold=settings.spec_threshold)
    if method == "draft":
        return _draft_model(folder, model, settings, max_len)
    if settings.placement == "remote":
        from specserve.methods.remote import RemoteProposer
        from specserve.triton import bls

        return RemoteProposer(method, bls.proposal_call(), max_draft_len=settings.max_draft_len,
                              threshold=settings.spec_threshold, release=bls.release_call())
    from specserve.methods.eagle.proposer import EagleProposer, load_eagle

    drafter = load_eagle(folder, model, dtype=resolve_drafter_dtype(settings.drafter_dtype, model))
    return EagleProposer(drafter, model, max_num_seqs=settings.max_num_seqs,
                         max_model_len=max_len, max_draft_len=settings.max_draft_len,
                         threshold=settings.spec_threshold, name=method)


def _draft_model(folder: str, model, settings: EngineSettings, max_len: int) -> "Proposer":
    from specserve.methods.draft.proposer import DraftModelProposer, load_draft_model

    # Refuses a draft model whose tokenizer does not give the target's ids (check_tokenizer).
    draft = load_draft_model(folder, model, load_tokenizer(settings.checkpoint),
                             dtype=resolve_drafter_dtype(settings.drafter_dtype, model))
    return DraftModelProposer(draft, max_num_seqs=settings.max_num_seqs, max_model_len=max_len,
                              max_draft_len=settings.max_draft_len)


def default_max_model_len(checkpoint: str | Path) -> int:
    from specserve.model.transformer import load_config
    return min(load_config(checkpoint).max_position_embeddings, 2048)


def build_engine(settings: EngineSettings):
    """→ (Engine, tokenizers.Tokenizer). Raises CheckpointError for an unusable checkpoint."""
    from specserve.core.engine import Engine, EngineConfig
    from specserve.model.transformer import load_model

    import torch

    if settings.dtype not in DTYPES:
        raise ValueError(f"dtype must be one of {', '.join(DTYPES)}, got {settings.dtype!r}")
    tokenizer = load_tokenizer(settings.checkpoint)
    model = load_model(settings.checkpoint, dtype=getattr(torch, settings.dtype),
                       device=resolve_device(settings.device))
    max_len = settings.max_model_len or default_max_model_len(settings.checkpoint)
    config = EngineConfig(max_num_seqs=settings.max_num_seqs, max_model_len=max_len,
                          max_draft_len=settings.max_draft_len, default_method=settings.default_method,
                          max_queue_len=settings.max_queue_len, draft_policy=settings.draft_policy)
    proposers = {name: make() for name, make in PROPOSERS.items()}
    for method, folder in settings.drafters:
        if method != "mtp":
            proposers[method] = _drafted(method, folder, model, settings, max_len)
    if "mtp" in served_methods(settings.drafters):
        proposers["mtp"] = _mtp(proposers, dict(settings.drafters).get("mtp"), model, settings)
    for method, base in STATIC_METHODS.items():
        folder = dict(settings.drafters).get(base)
        if folder:
            proposers[method] = _static(method, folder, model, settings, max_len, proposers.get(base))
    fault_injection.inject(proposers)   # a no-op unless a test asks for it
    engine = Engine(model, config, proposers, detokenize=make_decode(tokenizer))
    if model.device.type == "cuda":  # capture the static-step graphs now, not on a request's path
        for proposer in engine.proposers.values():
            if getattr(proposer, "static_step", False):
                proposer.warm()
    return engine, tokenizer
