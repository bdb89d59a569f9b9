"""Build the engine a deployment serves: model, tokenizer and each served method's proposer.

Which methods exist, what each drafts with and how it is built is the method registry's
(specserve/methods/registry.py); here the registry meets one deployment's settings. Shared by
the target_verifier model, the CLI and benchmarks.

Remote proposers call Triton models by BLS; those calls come from the Triton adapter
(specserve.triton.bls.remote_calls) as RemoteCalls. An engine built without them (in process:
the CLI's demo and bench, tests) runs every method fused.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from specserve.methods import registry
from specserve.model.devices import DTYPES, resolve_device, resolve_drafter_dtype
from specserve.model.tokenizer import load_tokenizer, make_decode
from specserve.serving import fault_injection

log = logging.getLogger("specserve.factory")

if TYPE_CHECKING:
    from specserve.core.proposer import AnyProposer, RemoteCalls

PLACEMENTS = registry.PLACEMENTS


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
    """Methods that run another method's drafter, where that drafter is served (dspark)."""
    served = {m for m, _ in drafters}
    return [m for m, base in registry.borrowed().items() if base in served]


def composite_methods(drafters: tuple[tuple[str, str], ...]) -> list[str]:
    """The composite (mtp), served as soon as one member's trained drafter is."""
    mtp = registry.composite()
    served = {m for m, _ in drafters}
    trained = {m.drafter for m in mtp.members if m.drafter}
    return [mtp.name] if served & trained and mtp.name not in served else []


def mtp_subproposers(drafters: tuple[tuple[str, str], ...]) -> list[str]:
    """The members `mtp` merges in a deployment with these drafters (in the mtp spec's order)."""
    return list(registry.served_members(drafters))


def mtp_runs_remote(mtp_placement: str, drafters: tuple[tuple[str, str], ...]) -> bool:
    """Whether mtp runs as the mtp_proposal ensemble: its placement is remote, mtp is served, and
    so are the drafters its remote placement needs (EAGLE: the ensemble's EAGLE models). The
    renderer and the engine both ask."""
    mtp = registry.composite()
    if mtp_placement not in PLACEMENTS:
        raise ValueError(f"{mtp.name} placement must be one of {', '.join(PLACEMENTS)}, got {mtp_placement!r}")
    served = {m for m, _ in drafters}
    return (mtp_placement == "remote" and mtp.name in served_methods(drafters)
            and all(need in served for need in mtp.remote_needs))


def where_drafters_run(drafters: tuple[tuple[str, str], ...], placement: str = "fused",
                       mtp_placement: str = "remote") -> list[str]:
    """One line per served drafter, and one for mtp, saying where it runs (for startup logs)."""
    from specserve.core.paths import shown

    mtp = registry.composite()
    served = mtp.name in served_methods(drafters)
    remote_mtp = served and mtp_runs_remote(mtp_placement, drafters)
    lines = []
    for method, folder in drafters:
        if method == mtp.name:   # the MTP heads run where mtp does
            where = "remote" if remote_mtp else "fused"
        else:
            where = "fused: no remote export" if registry.get(method).fused_only and placement == "remote" else placement
        lines.append(f"drafter {method} from {shown(folder)} ({where})")
    if served:
        needs = " and ".join(f"an {n.upper()} drafter" for n in mtp.remote_needs)
        where = ("remote: the mtp_proposal ensemble" if remote_mtp
                 else "fused" + (f": remote needs {needs}" if mtp_placement == "remote" else ""))
        lines.append(f"mtp merges {', '.join(mtp_subproposers(drafters))} ({where})")
    return lines


def served_methods(drafters: tuple[tuple[str, str], ...]) -> list[str]:
    plain = [s.name for s in registry.specs() if s.drafts_with == "nothing"]
    return [*plain, *(m for m, _ in drafters), *static_methods(drafters), *composite_methods(drafters)]


def available_methods(settings: EngineSettings) -> list[str]:
    return served_methods(settings.drafters)




def default_max_model_len(checkpoint: str | Path) -> int:
    from specserve.model.transformer import load_config
    return min(load_config(checkpoint).max_position_embeddings, 2048)


def _placement(spec: registry.MethodSpec, settings: EngineSettings, remote: "RemoteCalls | None") -> str:
    """Where `spec` runs in this deployment: the composite by its own placement (remote only with
    BLS calls to make), a drafter by the deployment's placement where it has a remote one."""
    if spec.drafts_with == "composite":
        return "remote" if remote is not None and mtp_runs_remote(settings.mtp_placement, settings.drafters) else "fused"
    if spec.drafts_with == "own" and settings.placement not in PLACEMENTS:
        raise ValueError(f"placement must be one of {', '.join(PLACEMENTS)}, got {settings.placement!r}")
    return settings.placement if settings.placement in spec.placements else "fused"


def build_proposers(model, settings: EngineSettings, max_len: int,
                    remote: "RemoteCalls | None" = None) -> dict[str, "AnyProposer"]:
    """Every served method's proposer but none's (the engine's own), in the registry's order of
    kinds: those drafting with nothing, with their own drafter, then the composite (over the
    others) and those borrowing another's drafter."""
    for method, _ in settings.drafters:
        if method not in registry.folder_methods():
            raise ValueError(f"unknown drafter method {method!r}; drafters: {', '.join(registry.with_drafts('own'))}")
    served = served_methods(settings.drafters)
    folders = dict(settings.drafters)
    dtype = resolve_drafter_dtype(settings.drafter_dtype, model)
    proposers: dict[str, "AnyProposer"] = {}
    for kind in ("nothing", "own", "composite", "other"):
        for spec in registry.specs():
            if spec.drafts_with != kind or spec.builder is None or spec.name not in served:
                continue
            placement = _placement(spec, settings, remote)
            if spec.drafts_with == "composite" and placement == "fused" and settings.mtp_placement == "remote":
                log.warning("%s runs fused: %s", spec.name,
                            "its remote placement needs an EAGLE drafter (mtp_proposal's EAGLE models), and none is served"
                            if remote is not None else "built in process, with no BLS calls to make")
            ctx = registry.BuildContext(model, Path(settings.checkpoint), folders.get(spec.name), settings.drafters,
                                        proposers, settings.max_num_seqs, max_len, settings.max_draft_len,
                                        settings.spec_threshold, dtype, settings.block_size, placement, remote)
            proposers[spec.name] = spec.build(ctx)
    return proposers


def build_engine(settings: EngineSettings, remote: "RemoteCalls | None" = None):
    """→ (Engine, tokenizers.Tokenizer). Raises CheckpointError for an unusable checkpoint.
    `remote`: the BLS calls of remote proposers (the target_verifier adapter's); None builds every
    method fused."""
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
    proposers = build_proposers(model, settings, max_len, remote)
    fault_injection.inject(proposers)   # a no-op unless a test asks for it
    engine = Engine(model, config, proposers, detokenize=make_decode(tokenizer))
    if model.device.type == "cuda":  # capture the static-step graphs now, not on a request's path
        for proposer in engine.proposers.values():
            if proposer.static_step:
                proposer.warm()
    return engine, tokenizer
