"""Build the engine a deployment serves: model, tokenizer and each served method's proposer.

Which methods exist, what each drafts with and how it is built is the method registry's
(specserve/methods/registry.py); here the registry meets one deployment's settings. Shared by
the target_verifier model, the CLI and benchmarks.

The deployment's settings are serving/settings.DeploymentSettings. Remote proposers call
Triton models by BLS; those calls come from the Triton adapter (specserve.triton.bls.remote_calls)
as RemoteCalls. An engine built without them (in process: benchmarks' drivers, tests) runs mtp
fused whatever its placement says (where_drafters_run and the build log say so), and refuses a
remote placement of a drafter.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import TYPE_CHECKING

from specserve.methods import registry
from specserve.model.devices import DTYPES, resolve_device, resolve_drafter_dtype
from specserve.model.tokenizer import load_tokenizer, make_decode
from specserve.serving import fault_injection
from specserve.serving.settings import DeploymentSettings

log = logging.getLogger("specserve.factory")

if TYPE_CHECKING:
    from specserve.core.proposer import AnyProposer, RemoteCalls

PLACEMENTS = registry.PLACEMENTS


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
            and all(need in served for need in mtp.remote_needs) and eagle3_drafter(drafters) is None)


def eagle3_drafter(drafters: tuple[tuple[str, str], ...]) -> str | None:
    """The served EAGLE drafter's folder when it is EAGLE-3-style (None otherwise): it has no
    ONNX export yet, so remote mtp, whose ensemble runs EAGLE's ONNX models, cannot run it."""
    from specserve.methods.eagle.drafter import is_eagle3_folder

    folder = dict(drafters).get("eagle")
    return folder if folder is not None and is_eagle3_folder(folder) else None


def mtp_fused_because(settings: DeploymentSettings, bls_calls: bool) -> str | None:
    """Why a served mtp whose placement is remote runs fused in this deployment (None: it does
    not, or its placement is fused)."""
    mtp = registry.composite()
    if settings.mtp_placement != "remote" or mtp.name not in served_methods(settings.drafters):
        return None
    if not bls_calls:
        return "built in process, with no BLS calls to make"
    if not mtp_runs_remote(settings.mtp_placement, settings.drafters):
        if eagle3_drafter(settings.drafters):
            return ("the EAGLE drafter is EAGLE-3-style, which has no ONNX export yet for the mtp_proposal "
                    "ensemble's EAGLE models")
        needs = " and ".join(f"an {n.upper()} drafter" for n in mtp.remote_needs)
        return f"remote needs {needs}"
    return None


def where_drafters_run(settings: DeploymentSettings, bls_calls: bool = True) -> list[str]:
    """One line per served drafter, and one for mtp, saying where it runs (for startup logs).
    `bls_calls`: whether the engine gets BLS calls (it does inside target_verifier; built in
    process it does not, and runs everything fused)."""
    from specserve.core.paths import shown

    mtp = registry.composite()
    drafters = settings.drafters
    served = mtp.name in served_methods(drafters)
    remote_mtp = served and bls_calls and mtp_runs_remote(settings.mtp_placement, drafters)
    lines = []
    for method, folder in drafters:
        if method == mtp.name:   # the MTP heads run where mtp does
            where = "remote" if remote_mtp else "fused"
        elif registry.get(method).fused_only and settings.placement == "remote":
            where = "fused: no remote export"
        else:
            where = settings.placement
        lines.append(f"drafter {method} from {shown(folder)} ({where})")
    if served:
        why = mtp_fused_because(settings, bls_calls)
        where = "remote: the mtp_proposal ensemble" if remote_mtp else "fused" + (f": {why}" if why else "")
        lines.append(f"mtp merges {', '.join(mtp_subproposers(drafters))} ({where})")
    return lines


def served_methods(drafters: tuple[tuple[str, str], ...]) -> list[str]:
    plain = [s.name for s in registry.specs() if s.drafts_with == "nothing"]
    return [*plain, *(m for m, _ in drafters), *static_methods(drafters), *composite_methods(drafters)]


def _placement(spec: registry.MethodSpec, settings: DeploymentSettings, remote: "RemoteCalls | None") -> str:
    """Where `spec` runs in this deployment: the composite by its own placement (remote only with
    BLS calls to make), a drafter by the deployment's placement where it has a remote one."""
    if spec.drafts_with == "composite":
        return "remote" if remote is not None and mtp_runs_remote(settings.mtp_placement, settings.drafters) else "fused"
    if spec.drafts_with == "own" and settings.placement not in PLACEMENTS:
        raise ValueError(f"placement must be one of {', '.join(PLACEMENTS)}, got {settings.placement!r}")
    return settings.placement if settings.placement in spec.placements else "fused"


def build_proposers(model, settings: DeploymentSettings, max_len: int,
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
            why = mtp_fused_because(settings, remote is not None) if spec.drafts_with == "composite" else None
            if why:
                log.warning("%s runs fused: %s", spec.name, why)
            ctx = registry.BuildContext(model, Path(settings.checkpoint), folders.get(spec.name), settings.drafters,
                                        proposers, settings.max_num_seqs, max_len, settings.max_draft_len,
                                        settings.spec_threshold, dtype, settings.block_size, placement, remote,
                                        settings.remote_timeout_s)
            proposers[spec.name] = spec.build(ctx)
    return proposers


def build_engine(settings: DeploymentSettings, remote: "RemoteCalls | None" = None):
    """→ (Engine, tokenizers.Tokenizer). Raises CheckpointError for an unusable checkpoint.
    With tensor_parallel N > 1 the engine's model is a TensorParallelTarget whose workers run
    until its close() (model/tp_processes.py).
    `remote`: the BLS calls of remote proposers (the target_verifier adapter's); None: built in
    process, where mtp runs fused (logged) and a remote placement of a drafter is refused."""
    from specserve.core.engine import Engine
    from specserve.model.dense_linear import resolve_linear_kernel, use_onednn_linears
    from specserve.model.invariant_attention import check_attention, require_row_invariance
    from specserve.model.quantize import check_quantization, kept_quantization, quantize_target, served_quantization
    from specserve.model.tensor_parallel import check_tensor_parallel
    from specserve.model.transformer import load_config, load_model

    import torch

    if settings.dtype not in DTYPES:
        raise ValueError(f"dtype must be one of {', '.join(DTYPES)}, got {settings.dtype!r}")
    tokenizer = load_tokenizer(settings.checkpoint)
    device = resolve_device(settings.device)
    # Refused before the weights are read: a quantization or tensor-parallel size this checkpoint /
    # device / dtype cannot run (--quantize, or the folder's own kept int4, which load_model builds
    # and --quantize may not redo).
    cfg = load_config(settings.checkpoint)
    served = served_quantization(settings.quantization(), kept_quantization(settings.checkpoint), settings.checkpoint)
    check_quantization(served, cfg, device.type, settings.dtype)
    check_tensor_parallel(cfg, settings.tensor_parallel, device, served.label())
    check_attention(settings.attention, device.type, settings.tensor_parallel)
    linear_kernel = resolve_linear_kernel(settings.linear_kernel, device.type, settings.dtype, settings.tensor_parallel)
    dtype = getattr(torch, settings.dtype)
    if settings.tensor_parallel > 1:
        from specserve.model.tp_processes import start_tensor_parallel

        model = start_tensor_parallel(settings.checkpoint, settings.tensor_parallel, dtype=dtype, device=device)
    else:
        model = quantize_target(load_model(settings.checkpoint, dtype=dtype, device=device), settings.quantization())
        if linear_kernel == "onednn":   # after quantization: the layers it kept dense
            log.info("linear kernel: onednn for the target's %d dense linear layers", use_onednn_linears(model))
        if settings.attention == "per-query":
            require_row_invariance(model, settings.max_num_seqs)
            model.per_query_attention = True
    try:
        config = settings.engine_config()
        proposers = build_proposers(model, settings, config.max_model_len, remote)
        fault_injection.inject(proposers)   # a no-op unless a test asks for it
        engine = Engine(model, config, proposers, detokenize=make_decode(tokenizer))
    except BaseException:
        if settings.tensor_parallel > 1:
            model.close()   # its workers
        raise
    if model.device.type == "cuda":  # capture the static-step graphs now, not on a request's path
        for proposer in engine.proposers.values():
            if proposer.static_step:
                proposer.warm()
    return engine, tokenizer
