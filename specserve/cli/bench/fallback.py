"""A small random-weight checkpoint for benchmarking when the demo model is absent.

Random weights measure the serving path's speed (tokenize, schedule, forward, stream), not
speculation quality: acceptance on random text says nothing about a trained model. The report
records which one ran.
"""

from __future__ import annotations

from pathlib import Path

from specserve.cli.bench.workload import REPO

DEMO_TARGET = REPO / "models" / "demo" / "target"


def has_weights(path: Path) -> bool:
    path = Path(path)
    return (path / "config.json").is_file() and any(path.glob("*.safetensors"))


def _tokenizer(out: Path) -> None:
    """The demo tokenizer when it is on disk (it lands before the weights), else the tiny BPE."""
    demo = DEMO_TARGET / "tokenizer.json"
    if demo.is_file():
        (out / "tokenizer.json").write_bytes(demo.read_bytes())
    else:
        from specserve.model.tiny import train_tiny_tokenizer
        train_tiny_tokenizer(out)


def random_checkpoint(out: Path, *, hidden: int = 384, layers: int = 18, heads: int = 6, kv_heads: int = 2,
                      max_len: int = 2048, seed: int = 0) -> Path:
    """A random Llama with a real tokenizer under `out` (reused if already there). The default
    shape is the demo model's (as benchmarks/engine_bench.py makes it), so speed figures are at
    the demo's scale."""
    import torch
    import transformers
    from tokenizers import Tokenizer

    out = Path(out)
    if has_weights(out) and (out / "tokenizer.json").is_file():
        return out
    out.mkdir(parents=True, exist_ok=True)
    _tokenizer(out)
    vocab = Tokenizer.from_file(str(out / "tokenizer.json")).get_vocab_size()
    cfg = transformers.LlamaConfig(vocab_size=vocab, hidden_size=hidden, intermediate_size=2 * hidden,
                                   num_hidden_layers=layers, num_attention_heads=heads,
                                   num_key_value_heads=kv_heads, max_position_embeddings=max_len,
                                   tie_word_embeddings=True, bos_token_id=None, eos_token_id=None)
    torch.manual_seed(seed)
    model = transformers.LlamaForCausalLM(cfg)
    with torch.no_grad():  # peaked next-token distributions, as a trained model has
        for p in model.parameters():
            if p.dim() == 2:
                p.normal_(0, 0.15)
    model.save_pretrained(str(out))
    return out
