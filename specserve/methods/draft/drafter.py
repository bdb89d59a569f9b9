"""The draft model: a separate small causal LM of the target's family, loaded and checked against it.

The draft model is an ordinary Hugging Face folder (config.json, model.safetensors, its own
tokenizer.json), loaded with specserve.model.transformer.load_model. It must speak the target's
token ids: `check_tokenizer` refuses to start a draft model whose tokenizer encodes the probe
string differently from the target's, naming the first differing position.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch

from specserve.model.transformer import CheckpointError, Transformer, load_model

# Where tokenizers part most often: emoji (multi-byte, ZWJ sequences, skin tones), XML tags,
# LaTeX, CJK, runs of spaces (code indentation), tabs and blank lines.
PROBE = ("<doc id=\"7\"><title>Tokenizer probe 🚀</title>\n"
         "  <p>Emoji 😀👍🏽 👨‍👩‍👧 ❤️ and CJK 中文字符，日本語のテキスト、한국어.</p>\n"
         "</doc>\n\n\n"
         "$$\\int_0^\\infty e^{-x^2}\\,dx = \\frac{\\sqrt{\\pi}}{2}, \\quad \\alpha_{i,j}^{(k)}$$\n"
         "def f(x):\n        return  x   *  2\t\t# tabs\n\n    \n"
         "    if x:\n\n\n\n        pass    \r\n  end\u00a0nbsp")

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json")


class TokenizerMismatch(CheckpointError):
    """The draft model's tokenizer does not produce the target's token ids."""


def _piece(tokenizer, token_id: int | None) -> str:
    if token_id is None:
        return "(end of encoding)"
    return repr(tokenizer.decode([token_id], skip_special_tokens=False))


def check_tokenizer(target_tokenizer, draft_tokenizer, probe: str = PROBE) -> None:
    """Raise TokenizerMismatch naming the first position where the two encodings of `probe`
    differ (index, both ids, both decoded pieces); return None when they are identical."""
    a = target_tokenizer.encode(probe, add_special_tokens=False).ids
    b = draft_tokenizer.encode(probe, add_special_tokens=False).ids
    if a == b:
        return
    i = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
    ta, tb = (a[i] if i < len(a) else None), (b[i] if i < len(b) else None)
    raise TokenizerMismatch(
        f"the draft model's tokenizer does not produce the target's token ids on the probe string "
        f"({len(a)} vs {len(b)} tokens); first difference at token {i}: target id {ta} "
        f"{_piece(target_tokenizer, ta)}, draft id {tb} {_piece(draft_tokenizer, tb)}")


def load_draft_model(folder: str | Path, target: Transformer, target_tokenizer, *,
                     dtype: torch.dtype | None = None) -> Transformer:
    """The draft model in `folder`, checked against the target: same vocabulary size, and its
    tokenizer.json encodes the probe string exactly as the target's does."""
    from specserve.model.tokenizer import load_tokenizer

    folder = Path(folder)
    draft_tokenizer = load_tokenizer(folder)
    check_tokenizer(target_tokenizer, draft_tokenizer)
    model = load_model(folder, dtype=dtype or target.dtype, device=target.device)
    if model.cfg.vocab_size != target.cfg.vocab_size:
        raise CheckpointError(f"draft model {folder}: vocab_size {model.cfg.vocab_size} != the target's "
                              f"{target.cfg.vocab_size}")
    return model


def save_draft_model(model: Transformer, folder: str | Path, *, tokenizer_from: str | Path,
                     extra_config: dict | None = None, dtype: torch.dtype = torch.bfloat16) -> None:
    """Write `model` as a Hugging Face Llama folder (separate q/k/v and gate/up projections; an
    lm_head tensor only when the embeddings are untied) with the tokenizer files of `tokenizer_from`."""
    from safetensors.torch import save_file

    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    c = model.cfg
    if c.model_type != "llama" or c.attention_bias or c.sliding_window or c.rope.rope_type != "default":
        raise ValueError("save_draft_model writes Llama models without attention bias, sliding window or "
                         "RoPE scaling")
    state = {}
    for k, v in model.state_dict().items():
        v = v.detach().to(dtype).contiguous()
        if k == "lm_head.weight":
            if not c.tie_word_embeddings:
                state[k] = v
        elif k.endswith("qkv_proj.weight"):
            p = k[: -len("qkv_proj.weight")]
            q, kk, vv = v.split([c.num_heads * c.head_dim, c.num_kv_heads * c.head_dim, c.num_kv_heads * c.head_dim])
            state |= {f"model.{p}q_proj.weight": q.contiguous(), f"model.{p}k_proj.weight": kk.contiguous(),
                      f"model.{p}v_proj.weight": vv.contiguous()}
        elif k.endswith("gate_up_proj.weight"):
            p = k[: -len("gate_up_proj.weight")]
            gate, up = v.chunk(2)
            state |= {f"model.{p}gate_proj.weight": gate.contiguous(), f"model.{p}up_proj.weight": up.contiguous()}
        else:
            state[f"model.{k}"] = v
    save_file(state, str(folder / "model.safetensors"), metadata={"format": "pt"})
    cfg = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_act": "silu",
           "vocab_size": c.vocab_size, "hidden_size": c.hidden_size, "intermediate_size": c.intermediate_size,
           "num_hidden_layers": c.num_layers, "num_attention_heads": c.num_heads,
           "num_key_value_heads": c.num_kv_heads, "head_dim": c.head_dim, "rms_norm_eps": c.rms_norm_eps,
           "rope_theta": c.rope.theta, "max_position_embeddings": c.max_position_embeddings,
           "tie_word_embeddings": c.tie_word_embeddings, "attention_bias": False, "mlp_bias": False,
           "bos_token_id": c.bos_token_id,
           "eos_token_id": list(c.eos_token_ids) if len(c.eos_token_ids) != 1 else c.eos_token_ids[0],
           "torch_dtype": str(dtype).removeprefix("torch."), "dtype": str(dtype).removeprefix("torch."),
           "specserve_drafter": "draft", **(extra_config or {})}
    (folder / "config.json").write_text(json.dumps(cfg, indent=2) + "\n")
    for name in TOKENIZER_FILES:
        src = Path(tokenizer_from) / name
        if src.is_file():
            shutil.copyfile(src, folder / name)
