"""Checks of what a user points the CLI at (a checkpoint, drafter folders), before any server
starts; shared by `specserve serve`, `bench` and `demo`. A problem is a CliError."""

from __future__ import annotations

import json
from pathlib import Path


class CliError(Exception):
    """A problem the user can fix; printed without a traceback, exit status 2."""


def check_checkpoint(target: Path, max_model_len: int | None) -> int:
    """Fail fast, before starting a server, on a checkpoint the engine cannot serve.
    Returns the max_model_len to use."""
    from specserve.model.transformer import CheckpointError, load_config
    from specserve.model.tokenizer import TokenizerError, load_tokenizer
    from specserve.serving.settings import default_max_model_len

    try:
        cfg = load_config(target)
        load_tokenizer(target)
    except (CheckpointError, TokenizerError) as e:
        raise CliError(f"cannot serve {target}: {e}") from None
    if not any(target.glob("*.safetensors")):
        raise CliError(f"cannot serve {target}: no *.safetensors weights")
    limit = cfg.max_position_embeddings
    if max_model_len is None:
        return default_max_model_len(limit)
    if not 0 < max_model_len <= limit:
        raise CliError(f"--max-model-len {max_model_len} must be in [1, {limit}] (the model's "
                       f"max_position_embeddings)")
    return max_model_len


def check_quantization_flags(target: Path, quantize: str, group_size: int, device_type: str, dtype: str,
                             head: str = "none") -> None:
    """--quantize / --quantize-group-size / --quantize-head against the checkpoint's shapes, the
    device and --dtype (the engine checks the same at load; here it fails before a server starts)."""
    from specserve.model.quantize import (Quantization, QuantizeError, check_quantization, kept_quantization,
                                          served_quantization)
    from specserve.model.transformer import load_config

    asked = Quantization(quantize, group_size, head)
    try:
        kept = kept_quantization(target)   # an import-gguf --keep-quantized folder's int4
        check_quantization(served_quantization(asked, kept, target), load_config(target), device_type, dtype)
    except QuantizeError as e:
        if kept is not None and asked.mode == "none":   # the folder's own quantization cannot run here
            raise CliError(f"cannot serve {target}: {e}") from None
        flag = ("--quantize-group-size" if "group size" in str(e) else
                "--quantize-head" if "quantize head" in str(e) else "--quantize")
        raise CliError(f"{flag}: {e}") from None


def check_attention_flag(mode: str, device_type: str, world: int) -> None:
    """--attention against the device and --tensor-parallel (the engine checks the same at load,
    and there also probes the target's row invariance, which needs the weights)."""
    from specserve.model.invariant_attention import check_attention

    try:
        check_attention(mode, device_type, world)
    except ValueError as e:
        raise CliError(str(e)) from None


def check_tensor_parallel_flag(target: Path, world: int, device: "torch.device", quantize: str) -> None:
    """--tensor-parallel against the checkpoint's heads, --quantize and the GPUs there are (the
    engine checks the same at load; here it fails before a server starts)."""
    from specserve.model.tensor_parallel import check_tensor_parallel
    from specserve.model.transformer import load_config

    try:
        check_tensor_parallel(load_config(target), world, device, quantize)
    except ValueError as e:
        raise CliError(f"--tensor-parallel: {e}") from None


def resolve_drafters(target: Path, flags: list[str], disabled: bool) -> tuple[tuple[str, str], ...]:
    """--drafter METHOD=DIR flags, else the drafters found beside the target (a folder named after
    its method whose config.json says so: models/demo/eagle, …/dflash, …/draft, …/mtp; an EAGLE-3
    drafter, specserve_drafter "eagle3", in …/eagle)."""
    from specserve.methods import registry

    names = registry.folder_methods()
    pairs = []
    for flag in flags:
        method, sep, folder = flag.partition("=")
        if not sep or not folder:
            raise CliError(f"--drafter expects METHOD=DIR, got {flag!r}")
        if method not in names:
            raise CliError(f"--drafter: unknown method {method!r}; drafters: {', '.join(names)}")
        if not (Path(folder) / "config.json").is_file():
            raise CliError(f"--drafter {flag}: {folder} has no config.json")
        pairs.append((method, folder))
    if disabled:
        return ()
    for method in names if not pairs else ():
        beside = target.resolve().parent / method / "config.json"
        kinds = registry.get(method).drafter_kinds
        if beside.is_file() and json.loads(beside.read_text()).get("specserve_drafter") in kinds:
            pairs.append((method, str(beside.parent)))
    return tuple(pairs)
