"""A tiny random Llama checkpoint with a byte-level BPE tokenizer trained on the spot.

For `make serve` / `make demo` before the bundled demo model exists, and for the Triton tests:
small enough to load in a second, with a real tokenizer.json so the whole tokenize → generate →
detokenize path runs. Its text is noise (random weights); its speed and plumbing are real.
"""

from __future__ import annotations

from pathlib import Path

# Mixed scripts so merges form inside multi-byte characters (CJK, emoji) as well as words.
CORPUS = [
    "The quick brown fox jumps over the lazy dog. " * 3,
    "Speculative decoding drafts tokens and the target verifies them in one pass.",
    "def add(a, b):\n    return a + b\n\nfor i in range(10):\n    print(i)\n",
    "你好，世界！我们今天学习中文。中国的首都是北京。学习使人快乐。",
    "日本語のテキストも少し入れます。東京は大きな都市です。",
    "Emoji time 😀😃😄 🚀🚀 🎉 ❤️ 👍🏽 — done!",
    "Numbers 0123456789 and symbols !@#$%^&*() are here too.",
]
SPECIAL = ["<unk>", "<s>", "</s>"]  # ids 0, 1, 2 = unk, bos, eos


def train_tiny_tokenizer(out_dir: str | Path, vocab_size: int = 400) -> Path:
    """Write out_dir/tokenizer.json: byte-level BPE, special tokens at ids 0-2."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=SPECIAL,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  show_progress=False)
    tok.train_from_iterator(CORPUS * 4, trainer)
    path = Path(out_dir) / "tokenizer.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    tok.save(str(path))
    return path


def make_tiny_llama(out_dir: str | Path, seed: int = 0, max_position_embeddings: int = 1024) -> Path:
    """A random 2-layer Llama (hidden 64) with the tiny tokenizer, saved with save_pretrained."""
    import torch
    import transformers
    from tokenizers import Tokenizer

    out = Path(out_dir)
    vocab = Tokenizer.from_file(str(train_tiny_tokenizer(out))).get_vocab_size()
    torch.manual_seed(seed)
    cfg = transformers.LlamaConfig(vocab_size=vocab, hidden_size=64, intermediate_size=128,
                                   num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                                   max_position_embeddings=max_position_embeddings,
                                   bos_token_id=1, eos_token_id=2)
    model = transformers.LlamaForCausalLM(cfg)
    with torch.no_grad():  # peaked next-token distributions, so greedy text is not all ties
        for p in model.parameters():
            if p.dim() == 2:
                p.normal_(0, 0.15)
    model.save_pretrained(str(out))
    return out
