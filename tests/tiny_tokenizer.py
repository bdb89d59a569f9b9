"""A small byte-level BPE tokenizer trained on the spot, saved as tokenizer.json beside a tiny
checkpoint so the Triton tests run the real tokenize → generate → detokenize path."""

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
SPECIAL = ["<unk>", "<s>", "</s>"]  # ids 0, 1, 2: the tiny checkpoints' bos=1, eos=2


def train_tiny_tokenizer(out_dir: str | Path, vocab_size: int = 400) -> Path:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=SPECIAL,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  show_progress=False)
    tok.train_from_iterator(CORPUS * 4, trainer)
    path = Path(out_dir) / "tokenizer.json"
    tok.save(str(path))
    return path
