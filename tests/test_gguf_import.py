"""specserve import-gguf: a GGUF file the test writes itself (tests/tiny_gguf.py) → a checkpoint
folder whose logits equal transformers' own load of the GGUF file."""

from __future__ import annotations

import json

import gguf
import numpy as np
import pytest
import torch
import transformers
from safetensors import safe_open

from specserve.cli.main import main
from specserve.model.gguf_import import GGUFImportError, import_gguf
from specserve.model.transformer import load_config, load_model
from tiny_gguf import CHATML, write_tiny_gguf

TOL = 1e-4  # our transformer against transformers' (tests/test_model.py)
PROMPT = [1, 57, 220, 301, 14, 99, 7, 300, 250]


def gguf_reference(path, dtype=torch.float32):
    """transformers' own load of the GGUF file (it dequantizes with the gguf package)."""
    return transformers.AutoModelForCausalLM.from_pretrained(
        str(path.parent), gguf_file=path.name, dtype=dtype).eval()


def logits_of(model, tokens) -> torch.Tensor:
    with torch.no_grad():
        return model(torch.tensor([tokens])).logits[0].float()


@pytest.mark.parametrize("arch,qtype,dtype", [("llama", "Q8_0", "float32"), ("qwen2", "Q4_0", "bfloat16")])
def test_imported_folder_equals_transformers_gguf_load(tmp_path, capsys, arch, qtype, dtype):
    src = write_tiny_gguf(tmp_path / f"{arch}.gguf", arch=arch, qtype=qtype)
    out = tmp_path / "imported"
    assert main(["import-gguf", str(src), str(out), "--dtype", dtype]) == 0
    assert f"wrote {out}" in capsys.readouterr().out

    torch_dtype = getattr(torch, dtype)
    ref = gguf_reference(src, torch_dtype)
    imported = transformers.AutoModelForCausalLM.from_pretrained(str(out), dtype=torch_dtype).eval()
    # The folder holds exactly the weights transformers dequantized: identical logits.
    assert torch.equal(logits_of(imported, PROMPT), logits_of(ref, PROMPT))
    with safe_open(str(out / "model.safetensors"), "pt") as f:
        assert {f.get_tensor(k).dtype for k in f.keys()} == {torch_dtype}
    if dtype == "float32":  # our transformer on the folder (bf16 rounding differs by design)
        ours = load_model(out)
        got = ours.score(torch.tensor([PROMPT]))[0]
        assert (got - logits_of(ref, PROMPT)).abs().max() <= TOL

    tok_cfg = json.loads((out / "tokenizer_config.json").read_text())
    assert tok_cfg["chat_template"] == CHATML
    tok = transformers.AutoTokenizer.from_pretrained(str(out))
    ref_tok = transformers.AutoTokenizer.from_pretrained(str(src.parent), gguf_file=src.name)
    text = "def add(a, b): 你好 😀"
    assert tok(text).input_ids == ref_tok(text).input_ids
    # The turn ends on <|im_end|>, read from generation_config.json.
    im_end = tok.convert_tokens_to_ids("<|im_end|>")
    assert json.loads((out / "generation_config.json").read_text())["eos_token_id"] == [im_end]
    assert im_end in load_config(out).eos_token_ids


@pytest.mark.parametrize("keep", [False, True])
def test_an_import_parses_the_file_once(tmp_path, monkeypatch, keep):
    """transformers' loading would parse the file for the config, the tokenizer and the weights,
    and inspect_gguf (and --keep-quantized) once more: the import shares one reader, and the
    library's own reader is back in place afterwards."""
    real, parses = gguf.GGUFReader, []

    def counting(path, mode="r"):
        parses.append(str(path))
        return real(path, mode)

    monkeypatch.setattr(gguf, "GGUFReader", counting)
    src = write_tiny_gguf(tmp_path / "llama.gguf", arch="llama", qtype="Q4_1" if keep else "Q8_0")
    import_gguf(src, tmp_path / "imported", keep_quantized=keep)
    assert parses == [str(src)]
    assert gguf.GGUFReader is counting


def test_unsupported_architecture_is_named(tmp_path):
    path = tmp_path / "phi3.gguf"
    w = gguf.GGUFWriter(str(path), "phi3")
    w.add_tensor("token_embd.weight", np.zeros((4, 32), np.float32))
    w.write_header_to_file(), w.write_kv_data_to_file(), w.write_tensors_to_file(), w.close()
    with pytest.raises(GGUFImportError, match=r"unsupported architecture 'phi3'.*llama, mistral, qwen2"):
        import_gguf(path, tmp_path / "out")
    assert main(["import-gguf", str(path), str(tmp_path / "out")]) == 2


def test_unsupported_quantization_type_is_named(tmp_path):
    path = tmp_path / "q81.gguf"
    w = gguf.GGUFWriter(str(path), "llama")
    block_elems, block_bytes = gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType.Q8_1]
    w.add_tensor("token_embd.weight", np.zeros((4, block_bytes), np.uint8),
                 raw_dtype=gguf.GGMLQuantizationType.Q8_1)
    w.write_header_to_file(), w.write_kv_data_to_file(), w.write_tensors_to_file(), w.close()
    with pytest.raises(GGUFImportError, match=r"unsupported quantization type\(s\) Q8_1"):
        import_gguf(path, tmp_path / "out")


def test_not_a_gguf_file(tmp_path):
    path = tmp_path / "model.gguf"
    path.write_bytes(b"not a gguf file at all")
    with pytest.raises(GGUFImportError, match="not a readable GGUF file"):
        import_gguf(path, tmp_path / "out")
    with pytest.raises(GGUFImportError, match="does not exist"):
        import_gguf(tmp_path / "missing.gguf", tmp_path / "out")
