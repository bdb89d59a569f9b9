"""Train the demo model's byte-level BPE tokenizer on the corpus's train split.

Byte-level BPE (GPT-2 style) covers every byte, so any text — emoji, CJK, stray binary in a
docstring — encodes and decodes back exactly; no unknown token is ever needed. 8192 entries keep
the LM head small (it is the biggest part of a one-layer drafter's cost) while still merging the
stdlib's common identifiers and indentation runs. Only the train split is seen, so held-out bits
per byte are honest.

    python training/train_tokenizer.py --out models/demo/target
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

sys.path.insert(0, str(Path(__file__).resolve().parent))  # sibling modules, run as a script
import corpus  # noqa: E402

VOCAB_SIZE = 8192


def train(docs: list[str], vocab_size: int = VOCAB_SIZE) -> Tokenizer:
    tok = Tokenizer(models.BPE())
    # add_prefix_space=False: code starts lines with no space; the GPT-2 split regex still keeps
    # runs of indentation together so they merge into single tokens.
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=2,
        special_tokens=[corpus.EOT],  # id 0: end of text, also used as bos
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),  # all 256 bytes, seen or not
        show_progress=True,
    )
    tok.train_from_iterator(docs, trainer=trainer, length=len(docs))
    return tok


def save(tok: Tokenizer, out: Path) -> None:
    """Write tokenizer.json + the transformers side files so AutoTokenizer loads the folder."""
    out.mkdir(parents=True, exist_ok=True)
    tok.save(str(out / "tokenizer.json"))
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": corpus.EOT,
        "eos_token": corpus.EOT,
        "unk_token": corpus.EOT,
        "pad_token": corpus.EOT,
        "add_bos_token": False,
        "add_eos_token": False,
        "clean_up_tokenization_spaces": False,  # would alter code like "a , b" on decode
        "model_max_length": 2048,
    }
    (out / "tokenizer_config.json").write_text(json.dumps(config, indent=2) + "\n")
    special = {k: corpus.EOT for k in ("bos_token", "eos_token", "unk_token", "pad_token")}
    (out / "special_tokens_map.json").write_text(json.dumps(special, indent=2) + "\n")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, default=corpus.REPO / "models" / "demo" / "target")
    ap.add_argument("--vocab-size", type=int, default=VOCAB_SIZE)
    args = ap.parse_args()
    docs = [d.text for d in corpus.documents(corpus.load_manifest(), "train")]
    tok = train(docs, args.vocab_size)
    save(tok, args.out)
    probe = "def f(x):\n    return x  # héllo 世界 🙂\n"
    assert tok.decode(tok.encode(probe).ids) == probe, "byte-level round trip failed"
    print(f"vocab {tok.get_vocab_size()}, eot id {tok.token_to_id(corpus.EOT)}, saved to {args.out}")


if __name__ == "__main__":
    main()
