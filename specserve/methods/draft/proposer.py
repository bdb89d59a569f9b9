"""Draft-model proposer: a separate small causal LM of the target's family drafts a chain.

The draft model is an ordinary Hugging Face folder (config.json, model.safetensors, its own
tokenizer.json), loaded with specserve.model.transformer.load_model, with its own small KV cache: one slot
per sequence. It must speak the target's token ids: `check_tokenizer` refuses to start a draft
model whose tokenizer encodes the probe string differently from the target's, naming the first
differing position.

Per sequence the proposer remembers which tokens its cache holds (`_SeqState.tokens`, the cache's
valid length is their count). A step:
  1. keeps the longest prefix of those that is still a prefix of the sequence (the engine's
     token_ids: prompt + emitted, the last one pending), and feeds the rest, pending token
     included, in one forward; its last row's logits give draft token 0;
  2. feeds each drafted token back, one forward per token, up to max_draft_len tokens. The last
     drafted token is never fed (nothing would read its KV).
`observe` rolls the cache back to the pending token plus the accepted drafted tokens, whose KV is
right; step 1 of the next call re-checks that against the real tokens (the recovered/bonus token
is always fed then, it was never drafted here).

Greedy requests draft the argmax; sampled requests draw from the draft model's distribution
warped by the request's temperature / top-k / top-p, and `probs` carries it for lossless
verification (greedy drafts carry the plain softmax, as a confidence only).
"""

from __future__ import annotations

import json
import shutil
from dataclasses import dataclass
from pathlib import Path

import torch

from specserve.core.masks import build_mask, chain_parents
from specserve.model.transformer import CheckpointError, ForwardBatch, Transformer, load_model
from specserve.core.proposer import Draft, DraftRequest, ProposerDefaults, ProposerError, StepOutcome
from specserve.core.sampling import target_probs

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
    """Write `model` as a Hugging Face Llama folder (separate q/k/v and gate/up projections, tied
    embeddings: no lm_head tensor) with the tokenizer files of `tokenizer_from`."""
    from safetensors.torch import save_file

    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    c = model.cfg
    if not c.tie_word_embeddings or c.model_type != "llama":
        raise ValueError("save_draft_model writes tied-embedding Llama models")
    state = {}
    for k, v in model.state_dict().items():
        if k == "lm_head.weight":
            continue
        v = v.detach().to(dtype).contiguous()
        if k.endswith("qkv_proj.weight"):
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
           "tie_word_embeddings": True, "attention_bias": False, "mlp_bias": False,
           "bos_token_id": c.bos_token_id,
           "eos_token_id": list(c.eos_token_ids) if len(c.eos_token_ids) != 1 else c.eos_token_ids[0],
           "torch_dtype": str(dtype).removeprefix("torch."), "dtype": str(dtype).removeprefix("torch."),
           "specserve_drafter": "draft", **(extra_config or {})}
    (folder / "config.json").write_text(json.dumps(cfg, indent=2) + "\n")
    for name in TOKENIZER_FILES:
        src = Path(tokenizer_from) / name
        if src.is_file():
            shutil.copyfile(src, folder / name)


# -- the proposer ----------------------------------------------------------------------------------

@dataclass
class _SeqState:
    slot: int
    tokens: list[int]   # the tokens whose KV the draft cache holds, in order
    base: int = 0       # len(token_ids) at the last propose (through the pending token)


class DraftModelProposer(ProposerDefaults):
    """Fused draft-model proposer: the small LM runs in the engine's process, batched over rows."""

    name = "draft"
    needs_features = False

    def __init__(self, draft: Transformer, *, max_num_seqs: int, max_model_len: int,
                 max_draft_len: int = 8, name: str = "draft"):
        self.draft, self.name = draft, name
        self.max_draft_len = max_draft_len
        # Room past max_model_len: drafted tokens are fed after the sequence's last token.
        self.cache = draft.new_cache(max_num_seqs, max_model_len + max_draft_len + 1)
        self._seqs: dict[int, _SeqState] = {}

    def _forward(self, rows: list[_SeqState], new: list[list[int]]) -> torch.Tensor:
        """Feed new[b] after rows[b].tokens (all rows in one padded forward) → logits [B, V] of
        each row's last new token. Updates each row's tokens and cache length."""
        dev = self.draft.device
        T = max(len(n) for n in new)
        starts = [len(st.tokens) for st in rows]
        tokens = torch.zeros(len(rows), T, dtype=torch.long)
        for b, n in enumerate(new):
            tokens[b, :len(n)] = torch.tensor(n)
        mask, positions = build_mask(starts, [chain_parents(len(n)) for n in new], T,
                                     sliding_window=self.draft.cfg.sliding_window)
        batch = ForwardBatch(tokens.to(dev), positions.to(dev), torch.tensor([st.slot for st in rows], device=dev),
                             torch.tensor(starts, device=dev), mask.to(dev))
        hidden = self.draft.forward(batch, self.cache).hidden  # [B, T, D]
        last = hidden[torch.arange(len(rows)), torch.tensor([len(n) - 1 for n in new])]  # [B, D]
        for st, n in zip(rows, new):
            st.tokens += n
            self.cache.truncate(st.slot, len(st.tokens))
        return self.draft.logits(last)  # [B, V] fp32

    def _catch_up(self, requests: list[DraftRequest], states: list[_SeqState]) -> torch.Tensor:
        """Bring each row's cache to its token_ids (pending token included) → logits [B, V]."""
        new = []
        for r, st in zip(requests, states):
            keep = 0
            limit = min(len(st.tokens), len(r.token_ids) - 1)  # the pending token is always fed
            while keep < limit and st.tokens[keep] == r.token_ids[keep]:
                keep += 1
            del st.tokens[keep:]
            self.cache.truncate(st.slot, keep)
            new.append(list(r.token_ids[keep:]))
        # On the draft model's device: a sampled row draws with the request's generator, which
        # lives on the engine's device.
        logits = torch.zeros(len(requests), self.draft.cfg.vocab_size, device=self.draft.device)
        # Padding is written to the cache too (after each row's tokens): a row with a long catch-up
        # (a new sequence's prompt) must not pad a row that is already far along past the pool.
        groups: dict[bool, list[int]] = {}
        for b, (st, n) in enumerate(zip(states, new)):
            groups.setdefault(len(st.tokens) == 0, []).append(b)
        for idx in groups.values():
            T = max(len(new[b]) for b in idx)
            if max(len(states[b].tokens) for b in idx) + T > self.cache.max_len:
                chunks = [[b] for b in idx]  # too long to pad together: one forward per row
            else:
                chunks = [idx]
            for chunk in chunks:
                logits[chunk] = self._forward([states[b] for b in chunk], [new[b] for b in chunk])
        return logits

    @torch.inference_mode()
    def propose(self, requests: list[DraftRequest]) -> list[Draft]:
        if not requests:
            return []
        fresh = [r.seq_id for r in requests if r.seq_id not in self._seqs]
        if len(fresh) > self.cache.num_free:
            raise ProposerError(f"no free draft-model slot for {len(fresh) - self.cache.num_free} sequence(s)")
        for sid in fresh:
            self._seqs[sid] = _SeqState(self.cache.allocate(), [])
        states = [self._seqs[r.seq_id] for r in requests]
        for r, st in zip(requests, states):
            st.base = len(r.token_ids)
        logits = self._catch_up(requests, states)  # [B, V] predicts draft token 0
        limits = [min(r.max_draft_len, self.max_draft_len) for r in requests]
        tokens: list[list[int]] = [[] for _ in requests]
        probs: list[list[torch.Tensor]] = [[] for _ in requests]
        active = [b for b, lim in enumerate(limits) if lim > 0]
        while active:
            for b in active:
                r = requests[b]
                if r.generator is None:
                    q = logits[b].softmax(-1)
                    tok = int(logits[b].argmax())
                else:
                    q = target_probs(logits[b:b + 1], r.params)[0]
                    tok = int(torch.multinomial(q, 1, generator=r.generator))
                tokens[b].append(tok)
                probs[b].append(q)
            active = [b for b in active if len(tokens[b]) < limits[b]]
            if active:
                logits[active] = self._forward([states[b] for b in active], [[tokens[b][-1]] for b in active])
        return [Draft.chain(t, torch.stack(p) if p else None) for t, p in zip(tokens, probs)]

    def observe(self, outcomes: list[StepOutcome]) -> None:
        """Roll each sequence's cache back to its pending token + the accepted drafted tokens."""
        for o in outcomes:
            st = self._seqs.get(o.seq_id)
            if st is None:
                continue
            keep = min(len(st.tokens), st.base + len(o.accepted_nodes))
            del st.tokens[keep:]
            self.cache.truncate(st.slot, keep)

    def release(self, seq_id: int) -> None:
        st = self._seqs.pop(seq_id, None)
        if st is not None:
            self.cache.release(st.slot)
