"""One deployment's settings, declared once: DeploymentSettings.

Every setting is one field with one default, and its field metadata says how it travels:
  * as a target_verifier model parameter (to_params / from_params: the renderer writes them,
    the adapter reads them back, because ensembles cannot carry constants; docs/design.md,
    'One settings object');
  * as a `specserve serve` flag (add_arguments / from_args: help, choices and default come from
    the field, so the CLI cannot disagree with the settings).

The defaults are a served deployment's (what `specserve serve` runs). Where the core's
EngineConfig has the same setting, the default is read from EngineConfig's field, never copied;
EngineConfig itself is built from these settings (engine_config) and stays the core's own.

A setting whose value `serve` finds rather than takes (the drafters beside the target, the
tiers file, the text classifier beside the target) has no generated flag of its own: the CLI
resolves it and hands the result to from_args.
"""

from __future__ import annotations

import argparse
import dataclasses
from dataclasses import MISSING, dataclass, field, replace
from pathlib import Path
from typing import Any, Callable, Mapping

from specserve.core.draft_policy import POLICIES
from specserve.core.config import EngineConfig
from specserve.methods import registry
from specserve.model.dense_linear import LINEAR_KERNELS
from specserve.model.devices import DRAFTER_DTYPES, DTYPES
from specserve.model.invariant_attention import ATTENTION_MODES
from specserve.model.quantize import DEFAULT_GROUP_SIZE, HEAD_MODES, INT4_GROUP_SIZES, QUANTIZE_MODES, Quantization
from specserve.serving.auth import new_key
from specserve.serving.text_classifier import DEFAULT_DFLASH_TYPES, TEXT_TYPES
from specserve.serving.tiers import Tier

# How remote drafter models run (triton/drafter_backends.py): onnxruntime inside a Python model,
# or Triton's native onnxruntime / tensorrt backends where a model is stateless.
DRAFTER_BACKENDS = ("python", "onnxruntime", "tensorrt")
PLAIN = registry.names()[0]   # "none": plain decoding, always served

_ENGINE = {f.name: f.default for f in dataclasses.fields(EngineConfig)}


def default_max_model_len(max_position_embeddings: int) -> int:
    """max_model_len when none is given: the model's limit, at most EngineConfig's default."""
    return min(max_position_embeddings, _ENGINE["max_model_len"])


@dataclass(frozen=True)
class Codec:
    """A setting's value as a model parameter string, and back."""
    encode: Callable[[Any], str]
    decode: Callable[[str], Any]


def _optional(kind: Callable[[str], Any]) -> Codec:
    return Codec(lambda v: "" if v is None else str(v), lambda s: kind(s) if s else None)


def _encode_drafters(drafters: tuple[tuple[str, str], ...]) -> str:
    """(method, folder) pairs as one string, "eagle=/abs/path;…" (absolute: Triton's working
    directory is not the caller's)."""
    return ";".join(f"{m}={Path(f).resolve()}" for m, f in drafters)


def _decode_drafters(text: str) -> tuple[tuple[str, str], ...]:
    return tuple(tuple(item.split("=", 1)) for item in text.split(";") if item)  # type: ignore[misc]


STR = Codec(str, str)
INT = Codec(str, int)
FLOAT = Codec(str, float)
OPTIONAL_INT = _optional(int)
OPTIONAL_FLOAT = _optional(float)
OPTIONAL_STR = _optional(str)
PATH = Codec(lambda v: str(Path(v).resolve()), Path)
DRAFTERS = Codec(_encode_drafters, _decode_drafters)


def setting(default: Any = MISSING, *, help: str, param: Codec | None = None, flag: str | None = "",
            cli_type: Callable[[str], Any] | None = None, choices: tuple[str, ...] | None = None,
            metavar: str | None = None, default_factory: Any = MISSING, repr: bool = True) -> Any:
    """A DeploymentSettings field. `param`: how it travels as a target_verifier parameter (None:
    it does not). `flag`: its `serve` flag ("" → --name-with-dashes; None: no generated flag).
    `cli_type`: the flag's converter (default: the param codec's decode, else str)."""
    meta = {"help": help, "param": param, "flag": flag, "cli_type": cli_type, "choices": choices,
            "metavar": metavar}
    return field(default=default, default_factory=default_factory, repr=repr, metadata=meta)


@dataclass(frozen=True)
class DeploymentSettings:
    checkpoint: Path = setting(help="checkpoint folder of the target model", param=PATH, flag="--target",
                               cli_type=Path)
    max_num_seqs: int = setting(_ENGINE["max_num_seqs"], param=INT, help="sequences decoded at once (KV slots)")
    max_model_len: int | None = setting(
        None, param=OPTIONAL_INT, cli_type=int,
        help=f"prompt + output tokens per sequence (default: min(model limit, {_ENGINE['max_model_len']}))")
    max_draft_len: int = setting(_ENGINE["max_draft_len"], param=INT, help="drafted tokens per step, at most")
    default_method: str | None = setting(
        None, param=OPTIONAL_STR, cli_type=str,
        help="speculation method for requests that do not set spec_method "
             f"(default: the first served drafter's method, eagle when one is served, else {PLAIN})")
    # (method, drafter folder), e.g. ("eagle", "models/demo/eagle"); serve finds them (--drafter,
    # else the folders beside the target).
    drafters: tuple[tuple[str, str], ...] = setting((), param=DRAFTERS, flag=None,
                                                    help="served drafters: (method, folder) pairs")
    placement: str = setting(
        "fused", param=STR, choices=registry.PLACEMENTS,
        help="drafters inside the engine (fused) or as hot-loadable Triton models (remote, server in "
             "explicit model-control mode; see `specserve drafters`)")
    # An engine built in process (no BLS calls: the CLI's bench drivers, tests) runs mtp fused
    # whatever this says; where_drafters_run and the builder's log say so.
    mtp_placement: str = setting(
        "remote", param=STR, choices=registry.PLACEMENTS,
        help="where mtp's drafters run: remote (the mtp_proposal ensemble: each drafter a hot-loadable "
             "Triton model, all in parallel; needs an EAGLE drafter, else mtp runs fused) or fused "
             "(one after another inside the engine)")
    spec_threshold: float | None = setting(
        0.3, param=OPTIONAL_FLOAT, cli_type=float,
        help="EAGLE stops drafting when the calibration head's predicted cumulative acceptance falls "
             "below this, DFlash when the product of its top-1 probabilities does (a request may "
             "override it with spec_threshold)")
    # float32 is exact: spec output equals plain decoding token for token. bfloat16 is faster on
    # hardware with bf16 matmuls, but its kernels round differently for a 1-token step and a
    # K+1-token verify, so outputs may part at near-ties.
    dtype: str = setting(
        "float32", param=STR, choices=DTYPES,
        help="compute dtype of the target; float32 (default) keeps greedy output token-exact vs plain "
             "decoding, bfloat16 is faster where the CPU/GPU has bf16 matmuls but may part from plain "
             "decoding at near-ties (bf16 rounding)")
    # Weight-only quantization of the target's decoder projections at load (model/quantize.py);
    # the activations, KV cache, embedding and LM head stay in --dtype. Lossless relative to
    # the quantized target: speculation never changes what it would produce.
    quantize: str = setting(
        "none", param=STR, choices=QUANTIZE_MODES,
        help="weight-only quantization of the target's linear layers at load: int8 (one scale per output "
             "channel) or int4 (a scale and zero per group of input features); activations stay in --dtype "
             "(int4 on CUDA needs bfloat16)")
    quantize_group_size: int = setting(
        DEFAULT_GROUP_SIZE, param=INT, metavar="G",
        help=f"int4's group size: input features per scale and zero, one of "
             f"{', '.join(map(str, INT4_GROUP_SIZES))} that divides every layer's input features")
    # The LM head apart from the projections: the largest single read of a quantized step on a
    # small model (SmolLM2: 49 152 x 576), and the drafters keep reading its dense weight.
    quantize_head: str = setting(
        "none", param=STR, choices=HEAD_MODES,
        help="int8: the target's logits from an int8 copy of its LM head (one scale per vocabulary row; "
             "the embedding and the drafters keep the dense weight); works with or without --quantize, "
             "and on a folder kept quantized by import-gguf")
    # SDPA rounds a query by the shape of its call, so a bf16 verify parts from plain decoding at
    # near-ties; per-query attention (model/invariant_attention.py) makes every verify row the
    # same bits as that token's decode step, where the linears are row-invariant (quantized
    # kernels, bf16), at a call shape fixed by each query's position.
    attention: str = setting(
        "batched", param=STR, choices=ATTENTION_MODES,
        help="batched: one SDPA call per forward (fastest); per-query: each query's attention in a call "
             "shaped by its own position alone, so a verify row rounds as its decode step would and greedy output "
             "with --dtype bfloat16 and --quantize int8|int4 (with --quantize-head int8) equals plain "
             "decoding token for token (CPU, one process)")
    # The kernel of the target's dense linears on a CPU (model/dense_linear.py): float32 BLAS
    # measured 2.3x slower than oneDNN at 1 row here, and worse at the 2-3 rows of a short verify.
    linear_kernel: str = setting(
        "auto", param=STR, choices=LINEAR_KERNELS,
        help="the target's dense linear layers: onednn (PyTorch's oneDNN linear, CPU), aten (nn.Linear as "
             "PyTorch dispatches it) or auto (onednn for a float32 target on a CPU, one process)")
    # Never affects the output, which the target verifies. Remote drafters run their exported
    # fp32 ONNX models.
    drafter_dtype: str = setting(
        "auto", param=STR, choices=DRAFTER_DTYPES,
        help="compute dtype of fused drafters (never changes the output, only the speed and the "
             "acceptance); auto = bfloat16 where the hardware has bf16 matmuls")
    device: str = setting(
        "auto", param=STR, metavar="auto|cpu|cuda[:N]",
        help="where the target, its KV pool, fused drafters and the static step run (auto: CUDA when "
             "available); float32 keeps greedy output token-exact on either")
    # Megatron-style sharding of the target (model/tensor_parallel.py): rank 0 runs the engine in
    # this process, ranks 1 … N−1 are worker processes it starts (model/tp_processes.py).
    tensor_parallel: int = setting(
        1, param=INT, metavar="N",
        help="shard the target over N ranks (tensor parallelism, one process and device each; rank 0 runs "
             "the engine): N must divide the model's KV heads, query heads and MLP width, and on CUDA "
             "there must be N GPUs from --device's on")
    # A healthy remote draft round trip takes ~9 ms on the demo model (CPU); past this the step
    # decodes plainly and the drafter counts as hung until it answers (methods/remote.py).
    remote_timeout_s: float = setting(
        1.0, param=FLOAT, flag="--remote-timeout", cli_type=float, metavar="SECONDS",
        help="a remote drafter call (--placement remote, mtp's remote drafters) that takes longer than "
             "this decodes its step plainly; the drafter is not called again until it answers")
    max_queue_len: int = setting(
        _ENGINE["max_queue_len"], param=INT,
        help="requests waiting for a KV slot, at most; beyond it requests are refused at once with "
             "'server busy'")
    draft_policy: str = setting(
        "adaptive", param=STR, choices=POLICIES,
        help="adaptive: each step drafts the length with the best expected goodput at the current load "
             "(verify costs profiled at start), so a busy server drafts less or not at all; fixed: always "
             "up to --max-draft-len. A request may choose with draft_policy")
    block_size: int | None = setting(
        None, param=OPTIONAL_INT, flag="--dflash-block-size", cli_type=int, metavar="B",
        help="dflash's block size B for requests that do not set dflash_block_size (drafts up to B - 1 "
             "tokens per step, and at most --max-draft-len); default: the drafter's config.json")
    # Signs preprocess → target_verifier and authorises internal calls (auth.py). A fresh one per
    # deployment; Triton's model-config endpoint, which would show it, is admin-only.
    internal_key: str = setting(default_factory=new_key, repr=False, param=STR, flag=None,
                                help="the internal key")
    # Service tiers (tiers.py): one llm_<tier> + preprocess_<tier> each; a tier named "default"
    # sets llm's own settings. serve loads them from --tiers FILE.
    tiers: tuple[Tier, ...] = setting((), flag=None, help="service tiers")
    drafter_backend: str = setting(
        "python", choices=DRAFTER_BACKENDS,
        help="remote drafter models (--placement remote) on onnxruntime inside a Python model (python), "
             "or on Triton's native onnxruntime / tensorrt backend where a model is stateless (the "
             "calibration head; eagle_backbone keeps per-sequence state and stays Python). The server "
             "must have that backend (the pip tritonserver has only python)")
    # The text-type gate (text_gate.py): a classifier folder (model.onnx + config.json) served as
    # text_classifier. None: no gate, dflash runs for every text.
    text_classifier: str | None = setting(
        None, cli_type=Path, metavar="DIR",
        help="text-type gate for dflash requests (specserve/serving/text_gate.py): a classifier folder "
             "(model.onnx + config.json), served as the hot-loadable model text_classifier; without it, "
             "a folder 'text_classifier' beside the target is used when dflash is served")
    # The text types whose dflash requests keep dflash (a tier's proposer.dflash_text_types
    # overrides them); the flag is a comma list, parsed (and refused) by serve.
    dflash_text_types: tuple[str, ...] = setting(
        DEFAULT_DFLASH_TYPES, cli_type=str, metavar="TYPES",
        help=f"comma list of the text types ({', '.join(TEXT_TYPES)}) whose dflash requests keep dflash; "
             f"the others run their fallback (spec_fallback, else the tier's fallback, else ngram). A "
             f"tier's proposer.dflash_text_types overrides it (default: {','.join(DEFAULT_DFLASH_TYPES)})")

    # -- resolved values ---------------------------------------------------------------------
    def model_len(self) -> int:
        """max_model_len, or the default for this checkpoint."""
        if self.max_model_len is not None:
            return self.max_model_len
        from specserve.model.transformer import load_config
        return default_max_model_len(load_config(self.checkpoint).max_position_embeddings)

    def method_by_default(self) -> str:
        """default_method, or the first served drafter's method, else plain decoding."""
        if self.default_method is not None:
            return self.default_method
        return self.drafters[0][0] if self.drafters else PLAIN

    def resolved(self) -> "DeploymentSettings":
        """These settings with max_model_len and default_method filled in (what is rendered)."""
        return replace(self, max_model_len=self.model_len(), default_method=self.method_by_default())

    def quantization(self) -> Quantization:
        return Quantization(self.quantize, self.quantize_group_size, self.quantize_head)

    def engine_config(self) -> EngineConfig:
        """The core's EngineConfig for this deployment."""
        return EngineConfig(max_num_seqs=self.max_num_seqs, max_model_len=self.model_len(),
                            max_draft_len=self.max_draft_len, default_method=self.method_by_default(),
                            max_queue_len=self.max_queue_len, draft_policy=self.draft_policy)

    # -- target_verifier's model parameters --------------------------------------------------
    def to_params(self) -> dict[str, str]:
        """target_verifier's config.pbtxt parameters (every field with a param codec)."""
        return {f.name: f.metadata["param"].encode(getattr(self, f.name)) for f in _param_fields()}

    @classmethod
    def from_params(cls, params: Mapping[str, str]) -> "DeploymentSettings":
        """The inverse of to_params; a parameter left out keeps its field's default."""
        return cls(**{f.name: f.metadata["param"].decode(params[f.name])
                      for f in _param_fields() if f.name in params})


def _param_fields() -> list[dataclasses.Field]:
    return [f for f in dataclasses.fields(DeploymentSettings) if f.metadata["param"] is not None]


def _flag(f: dataclasses.Field) -> str | None:
    flag = f.metadata["flag"]
    return f"--{f.name.replace('_', '-')}" if flag == "" else flag


def cli_fields() -> list[dataclasses.Field]:
    """The fields `serve` has a generated flag for, in declaration order."""
    return [f for f in dataclasses.fields(DeploymentSettings) if _flag(f) is not None]


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """One flag per cli field: its help, choices, metavar and default are the field's (the
    default shown in the help where the help does not describe it)."""
    for f in cli_fields():
        meta, kw = f.metadata, {}
        if f.default is MISSING:
            kw["required"] = True
        else:
            kw["default"] = f.default
        if meta["choices"] is not None:
            kw["choices"] = meta["choices"]
        if meta["metavar"] is not None:
            kw["metavar"] = meta["metavar"]
        kind = meta["cli_type"] or (meta["param"].decode if meta["param"] is not None else str)
        shown = f.default not in (MISSING, None) and "default" not in meta["help"]
        text = meta["help"] + (" (default: %(default)s)" if shown else "")
        parser.add_argument(_flag(f), dest=f.name, type=kind, help=text, **kw)


def from_args(args: argparse.Namespace, **found: Any) -> DeploymentSettings:
    """The settings `serve`'s parsed flags give; `found`: what serve resolved instead (drafters,
    tiers, the text classifier, parsed text types, …), which wins over the flag's value."""
    values = {f.name: getattr(args, f.name) for f in cli_fields()}
    values.update(found)
    if isinstance(values.get("text_classifier"), Path):
        values["text_classifier"] = str(values["text_classifier"])
    return DeploymentSettings(**values)
