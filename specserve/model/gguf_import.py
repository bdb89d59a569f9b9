"""A GGUF file → a Hugging Face checkpoint folder that `specserve serve` takes.

Reading and dequantizing are the maintained libraries' work: `gguf`'s reader for the metadata,
transformers' GGUF loading (`from_pretrained(..., gguf_file=...)`, which dequantizes with `gguf`)
for the weights and the tokenizer. This module checks first what it can import and names what it
cannot (an architecture we do not serve, a quantization type `gguf` cannot dequantize), then writes
config.json, model.safetensors in the dtype asked for, tokenizer.json, tokenizer_config.json (with
the chat template) and generation_config.json (with the end-of-turn ids).

The weights are dequantized: the folder serves the GGUF's values exactly, at full precision
(float32) or rounded once to bfloat16. With keep_quantized (--keep-quantized) the decoder
projections stay as the file stores them instead (Q4_0 / Q4_1 → int4 group 32, gguf_q4.py and
q4_checkpoint.py), recorded in quantization_config.json; the rest is dequantized as above.
"""

from __future__ import annotations

import json
from collections import Counter
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

# GGUF's general.architecture values we serve (Mistral GGUFs say "llama"; Qwen2's say "qwen2").
SUPPORTED_ARCHITECTURES = ("llama", "mistral", "qwen2")
DTYPES = ("float32", "bfloat16")


class GGUFImportError(ValueError):
    """The GGUF file cannot be imported; the message names what is unsupported or missing."""


@dataclass(frozen=True)
class GGUFSummary:
    architecture: str
    tensor_types: dict[str, int]            # GGML type name → how many tensors have it
    undequantizable: tuple[str, ...]        # the type names `gguf` cannot dequantize
    chat_template: str | None
    end_ids: tuple[int, ...]                # eos and eot ids, the tokens that end a turn


def _field(reader, key: str):
    """A scalar or string metadata value, or None when the key is absent."""
    f = reader.fields.get(key)
    return None if f is None else f.contents()


def _can_dequantize(tensor) -> bool:
    """Whether `gguf` dequantizes this tensor's type: tried on its first block (cheap)."""
    import numpy as np
    from gguf import GGML_QUANT_SIZES, GGMLQuantizationType
    from gguf.quants import dequantize

    qtype = GGMLQuantizationType(tensor.tensor_type)
    if qtype in (GGMLQuantizationType.F32, GGMLQuantizationType.F16):
        return True
    _, type_size = GGML_QUANT_SIZES[qtype]
    block = np.ascontiguousarray(np.asarray(tensor.data).view(np.uint8).reshape(-1)[:type_size])
    try:
        dequantize(block, qtype)
    except NotImplementedError:
        return False
    return True


@contextmanager
def parsed_once() -> Iterator[None]:
    """Within it, every `gguf.GGUFReader(path)` of one file returns one parsed reader.

    transformers' GGUF loading parses the whole file again for the config, the tokenizer and the
    weights (`load_gguf_checkpoint` builds a GGUFReader each time), and the reader's parse is slow
    for a large vocabulary: on SmolLM2 (49 152 tokens, 48 900 merges: about 590 000 metadata
    parts, each a numpy memmap view) it was most of an import's time, four parses of one file.
    The reader is read-only (a memmap of the file), so sharing it changes nothing it returns."""
    import gguf

    real = gguf.GGUFReader
    readers: dict[tuple[str, str], object] = {}

    def shared(path, mode="r"):
        key = (str(Path(path).resolve()), mode)
        if key not in readers:
            readers[key] = real(path, mode)
        return readers[key]

    gguf.GGUFReader = shared
    try:
        yield
    finally:
        gguf.GGUFReader = real


def inspect_gguf(path: str | Path) -> GGUFSummary:
    """What import_gguf needs to know before loading the weights."""
    import gguf
    from gguf import GGMLQuantizationType

    path = Path(path)
    if not path.is_file():
        raise GGUFImportError(f"{path} does not exist")
    try:
        reader = gguf.GGUFReader(str(path))   # looked up here: parsed_once may share it
    except (ValueError, OSError) as e:  # gguf raises ValueError for a file without the GGUF magic
        raise GGUFImportError(f"{path} is not a readable GGUF file: {e}") from None
    arch = _field(reader, "general.architecture")
    types: Counter[str] = Counter()
    first_of_type = {}
    for t in reader.tensors:
        name = GGMLQuantizationType(t.tensor_type).name
        types[name] += 1
        first_of_type.setdefault(name, t)
    bad = tuple(sorted(n for n, t in first_of_type.items() if not _can_dequantize(t)))
    ends = [_field(reader, f"tokenizer.ggml.{k}_token_id") for k in ("eos", "eot")]
    return GGUFSummary(architecture=str(arch), tensor_types=dict(types), undequantizable=bad,
                       chat_template=_field(reader, "tokenizer.chat_template"),
                       end_ids=tuple(dict.fromkeys(int(i) for i in ends if i is not None)))


def check_importable(summary: GGUFSummary, path: Path) -> None:
    if summary.architecture not in SUPPORTED_ARCHITECTURES:
        raise GGUFImportError(f"{path}: unsupported architecture {summary.architecture!r}; "
                              f"specserve imports {', '.join(SUPPORTED_ARCHITECTURES)} GGUF files")
    if summary.undequantizable:
        raise GGUFImportError(f"{path}: unsupported quantization type(s) {', '.join(summary.undequantizable)} "
                              f"(the gguf package cannot dequantize them)")


def import_gguf(gguf_file: str | Path, out_dir: str | Path, dtype: str = "float32",
                keep_quantized: bool = False) -> Path:
    """Write the checkpoint folder `out_dir` from `gguf_file`; returns out_dir."""
    if dtype not in DTYPES:
        raise GGUFImportError(f"dtype must be one of {', '.join(DTYPES)}, got {dtype!r}")
    with parsed_once():
        return _import(Path(gguf_file).resolve(), Path(out_dir), dtype, keep_quantized)


def _import(gguf_file: Path, out: Path, dtype: str, keep_quantized: bool) -> Path:
    import gguf
    import torch
    import transformers

    from specserve.model.gguf_q4 import GGUFKeepError, check_keepable, kept_projections
    from specserve.model.q4_checkpoint import KEPT_FILE

    summary = inspect_gguf(gguf_file)
    check_importable(summary, gguf_file)
    reader = gguf.GGUFReader(str(gguf_file)) if keep_quantized else None
    if reader is not None:   # refused before the slow dequantizing load
        layers = int(_field(reader, f"{summary.architecture}.block_count"))
        try:
            check_keepable(reader, layers)
        except GGUFKeepError as e:
            raise GGUFImportError(f"{gguf_file}: {e}") from None
    where = dict(pretrained_model_name_or_path=str(gguf_file.parent), gguf_file=gguf_file.name)
    tokenizer = transformers.AutoTokenizer.from_pretrained(**where)
    if summary.chat_template and not tokenizer.chat_template:
        tokenizer.chat_template = summary.chat_template
    loaded = transformers.AutoModelForCausalLM.from_pretrained(
        **where, dtype=torch.float32, quantization_config=transformers.GgufConfig(dequantize=True))
    model = _plain_copy(loaded, getattr(torch, dtype))
    if summary.end_ids:
        # The turn ends on eos or on the end-of-turn token (ChatML's <|im_end|>, Llama 3's <|eot_id|>).
        model.generation_config.eos_token_id = list(summary.end_ids)
    out.mkdir(parents=True, exist_ok=True)
    if reader is None:
        model.save_pretrained(str(out), safe_serialization=True)
        (out / KEPT_FILE).unlink(missing_ok=True)   # a kept import's record, were it one before
    else:
        try:
            kept, report = kept_projections(reader, loaded, summary.architecture, layers)
        except GGUFKeepError as e:
            raise GGUFImportError(f"{gguf_file}: {e}") from None
        _save_kept(model, kept, report, gguf_file.name, out)
    _save_tokenizer(tokenizer, out)
    return out


def _save_kept(model, kept: dict, report, source: str, out: Path) -> None:
    """config.json, generation_config.json, model.safetensors with the kept projections in place
    of their dense weights (q4_checkpoint.py's layout), and quantization_config.json."""
    from safetensors.torch import save_file

    from specserve.model.q4_checkpoint import KEPT_FILE, to_stored

    model.config.save_pretrained(str(out))
    model.generation_config.save_pretrained(str(out))
    state = dict(model.state_dict())
    if model.config.tie_word_embeddings:
        del state["lm_head.weight"]   # the embedding itself
    for prefix, weights in kept.items():
        del state[f"{prefix}.weight"]
        state.update(to_stored(prefix, weights))
    (out / "model.safetensors.index.json").unlink(missing_ok=True)
    save_file({k: v.contiguous() for k, v in state.items()}, str(out / "model.safetensors"), metadata={"format": "pt"})
    (out / KEPT_FILE).write_text(json.dumps(report.record(source), indent=2) + "\n")


def _plain_copy(loaded, dtype):
    """The dequantized model without its GGUF quantization config, which transformers refuses to
    save: the same weights in a model built from the bare config (on "meta", so nothing is
    initialised twice), cast to `dtype`."""
    import copy

    import torch

    config = copy.deepcopy(loaded.config)
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    config.dtype = dtype
    with torch.device("meta"):
        model = type(loaded)(config)
    model.load_state_dict(loaded.state_dict(), assign=True)
    model.tie_weights()
    model.generation_config = copy.deepcopy(loaded.generation_config)
    return model.to(dtype).eval()


def _save_tokenizer(tokenizer, out: Path) -> None:
    """tokenizer.json and tokenizer_config.json, the chat template inside the latter (where every
    transformers version reads it), not in a separate chat_template.jinja."""
    tokenizer.save_pretrained(str(out))
    cfg_file = out / "tokenizer_config.json"
    cfg = json.loads(cfg_file.read_text())
    jinja = out / "chat_template.jinja"
    if tokenizer.chat_template:
        cfg["chat_template"] = tokenizer.chat_template
        jinja.unlink(missing_ok=True)
    cfg_file.write_text(json.dumps(cfg, indent=2, ensure_ascii=False) + "\n")
