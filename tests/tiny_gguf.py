"""A tiny random Llama-architecture GGUF file, written with the `gguf` package's GGUFWriter.

Its tokenizer is the tiny byte-level BPE one (specserve/model/tiny.py) stored the way llama.cpp
stores a GPT-2-style vocabulary (tokens, token types, merges); its matrices are quantized (Q8_0 by
default) so importing it exercises dequantization, its norms stay F32 as llama.cpp writes them.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

CHATML = ("{% for message in messages %}{{'<|im_start|>' + message['role'] + '\n' + message['content']"
          " + '<|im_end|>' + '\n'}}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}"
          "{% endif %}")
# ChatML's turn markers, added after the tiny tokenizer's own vocabulary.
CHAT_TOKENS = ("<|im_start|>", "<|im_end|>")


def _tokenizer_fields(folder: Path) -> tuple[list[str], list[int], list[str]]:
    """(tokens in id order, llama.cpp token types, merges) of the tiny tokenizer, ChatML tokens added."""
    from gguf import TokenType

    from specserve.model.tiny import SPECIAL, train_tiny_tokenizer

    model = json.loads(train_tiny_tokenizer(folder).read_text())["model"]
    vocab: dict[str, int] = model["vocab"]
    tokens = [t for t, _ in sorted(vocab.items(), key=lambda kv: kv[1])] + list(CHAT_TOKENS)
    special = set(SPECIAL) | set(CHAT_TOKENS)
    types = [int(TokenType.CONTROL if t in special else TokenType.NORMAL) for t in tokens]
    merges = [m if isinstance(m, str) else " ".join(m) for m in model["merges"]]
    return tokens, types, merges


def write_tiny_gguf(path: str | Path, *, arch: str = "llama", qtype: str = "Q8_0", seed: int = 0,
                    tie: bool = True, hidden: int = 64, layers: int = 2,
                    tensor_types: dict[str, str] | None = None) -> Path:
    """A random 2-layer model (hidden 64, 4 query / 2 KV heads) as a GGUF file at `path`.
    `tensor_types`: tensor name → quantization type for some matrices instead of `qtype`; a type the
    gguf package cannot quantize (the K-quants) gets random blocks, for tests that refuse it."""
    import gguf

    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tokens, types, merges = _tokenizer_fields(path.parent / f"{path.stem}_tokenizer")
    V, D, F, H, Hkv = len(tokens), hidden, 2 * hidden, 4, 2
    hd = D // H
    rng = np.random.default_rng(seed)
    w = gguf.GGUFWriter(str(path), arch)
    w.add_context_length(512)
    w.add_embedding_length(D)
    w.add_block_count(layers)
    w.add_feed_forward_length(F)
    w.add_head_count(H)
    w.add_head_count_kv(Hkv)
    w.add_rope_dimension_count(hd)
    w.add_rope_freq_base(100000.0)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_vocab_size(V)
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("default")
    w.add_token_list(tokens)
    w.add_token_types(types)
    w.add_token_merges(merges)
    w.add_bos_token_id(1)
    w.add_eos_token_id(tokens.index("<|im_end|>"))
    w.add_chat_template(CHATML)

    def matrix(name: str, rows: int, cols: int) -> None:
        quant = gguf.GGMLQuantizationType[(tensor_types or {}).get(name, qtype)]
        # Larger than init scale: peaked next-token distributions, so greedy is not decided by ties.
        values = rng.normal(0, 0.15, size=(rows, cols)).astype(np.float32)
        if quant == gguf.GGMLQuantizationType.F32:
            w.add_tensor(name, values)
            return
        try:
            blocks = gguf.quants.quantize(values, quant)
        except NotImplementedError:
            block_elems, block_bytes = gguf.GGML_QUANT_SIZES[quant]
            blocks = rng.integers(0, 256, size=(rows, cols // block_elems * block_bytes), dtype=np.uint8)
        w.add_tensor(name, blocks, raw_dtype=quant)

    def norm(name: str) -> None:
        w.add_tensor(name, (1 + rng.normal(0, 0.1, size=D)).astype(np.float32))

    matrix("token_embd.weight", V, D)
    norm("output_norm.weight")
    if not tie:
        matrix("output.weight", V, D)
    for i in range(layers):
        norm(f"blk.{i}.attn_norm.weight")
        norm(f"blk.{i}.ffn_norm.weight")
        matrix(f"blk.{i}.attn_q.weight", H * hd, D)
        matrix(f"blk.{i}.attn_k.weight", Hkv * hd, D)
        matrix(f"blk.{i}.attn_v.weight", Hkv * hd, D)
        matrix(f"blk.{i}.attn_output.weight", D, H * hd)
        matrix(f"blk.{i}.ffn_gate.weight", F, D)
        matrix(f"blk.{i}.ffn_up.weight", F, D)
        matrix(f"blk.{i}.ffn_down.weight", D, F)
        if arch == "qwen2":
            for proj, rows in (("q", H * hd), ("k", Hkv * hd), ("v", Hkv * hd)):
                w.add_tensor(f"blk.{i}.attn_{proj}.bias", rng.normal(0, 0.1, size=rows).astype(np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path
