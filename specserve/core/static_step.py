"""The static step: one speculative step as a fixed-shape, branch-free computation (docs/design.md, 'The methods').

For a batch bucket B and a draft length K, a step is a function of device tensors only:

    tokens      [B, K+1]  the pending token, then K drafted tokens (padding past draft_lens)
    lengths     [B]       committed KV entries of each row (= the pending token's position)
    slots       [B]       KV slot of each row (padded rows: a scratch slot nobody owns)
    draft_lens  [B]       drafted tokens that count, in [0, K] (padded rows: 0)
    sampling    per-row temperature / top-k / top-p / greedy flag / seed, as tensors
    uniforms    [B, K+1]  pre-drawn from each request's own generator: K acceptance tests, 1 draw
    noise       [B, K+1, V] seeded rows: the Gumbel noise of the positions the K+1 rows predict,
                computed on the device from the seeds (core/sampling.gumbel_noise)

The target attends over a KV span S taken from a small fixed set (`span_for`), masked by the
row lengths, so S does not change every step. Acceptance runs on the device without branches:
greedy by the cumulative product of matches, sampled by `u·q(x) < p(x)` with the recovered token
drawn from the normalised residual by inverse CDF on a pre-drawn uniform, seeded rows like greedy
ones with the coupled sample argmax(log p + g) in place of the argmax. The commit is a length
update. The host reads the emitted tokens and counts in ONE transfer per step (`to_host`).

Worked example (greedy, K = 3): a row with draft_lens = 2 drafts [7, 9] (the third column is
padding); the target's argmax per position is [7, 4, 5, 1]. matches = [1, 0, 0] (the padded
column never matches), cumprod = [1, 0, 0], accepted = 1; the recovered token is argmax[1] = 4,
emitted = [7, 4], count = 2, new length = length + 2 (the pending token and 7 now have KV).

KV lengths, host and device. `KVCache.lengths` (host) stays the source of truth. Each step
copies the rows' host lengths into the step's `lengths` input; the step computes
`new_lengths = lengths + counts` on the device and returns it with the emitted tokens in the one
transfer; the caller then applies it with `KVCache.truncate`. The device copy is never carried
from one step to the next, so the two cannot drift apart. Entries written past a row's new length
(rejected drafts, padding) are stale: masked by the next step and overwritten.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from specserve.core.forward import ForwardBatch, TargetModel
from specserve.core.kv_cache import KVCache
from specserve.core.sampling import SamplingParams, coupled_choice, gumbel_noise, seed_tensor, seeded

# Attention spans: the smallest power of two (at least MIN_SPAN) covering the longest row, or
# the whole cache ("full"; one graph per (B, K) on a GPU, where reading a longer span is cheap).
SPAN_SETS = ("pow2", "full")
MIN_SPAN = 64


def span_for(needed: int, max_len: int, span_set: str = "pow2") -> int:
    """The KV span a step with `needed` = max(lengths) + K + 1 entries reads, from the fixed set."""
    if span_set not in SPAN_SETS:
        raise ValueError(f"span set must be one of {', '.join(SPAN_SETS)}, got {span_set!r}")
    if needed > max_len:
        raise ValueError(f"a step needs {needed} KV entries; the cache holds {max_len}")
    if span_set == "full":
        return max_len
    span = MIN_SPAN
    while span < needed:
        span *= 2
    return min(span, max_len)


def bucket_for(n: int, max_rows: int) -> int:
    """Batch bucket: the smallest power of two ≥ n, capped at max_rows (the engine's max_num_seqs)."""
    b = 1
    while b < n:
        b *= 2
    return min(b, max_rows)


class DeviceKV:
    """The KV pool's write/read without host syncs (KVCache's own fast paths call int() and
    torch.equal on the slot tensor). Same tensors, same layout; always the indexed path."""

    def __init__(self, cache: KVCache):
        self.k, self.v = cache.k, cache.v
        self._heads = torch.arange(cache.k.shape[2], device=cache.k.device)

    def write(self, layer: int, slots: torch.Tensor, starts: torch.Tensor,
              k: torch.Tensor, v: torch.Tensor) -> None:
        # k, v [B, Hkv, T, hd] → entries starts[b] .. starts[b]+T-1 of slots[b]
        T = k.shape[2]
        cols = starts[:, None] + torch.arange(T, device=starts.device)[None]  # [B, T]
        idx = (slots[:, None, None], self._heads[None, :, None], cols[:, None, :])
        self.k[layer].index_put_(idx, k)
        self.v[layer].index_put_(idx, v)

    def read(self, layer: int, slots: torch.Tensor, span: int) -> tuple[torch.Tensor, torch.Tensor]:
        # → k, v [B, Hkv, span, hd]; the basic slice is taken first, so only the span is gathered
        return self.k[layer, :, :, :span][slots], self.v[layer, :, :, :span][slots]


# -- per-row sampling as tensors ------------------------------------------------------------------

@dataclass
class SamplingTensors:
    greedy: torch.Tensor       # [B] bool
    temperature: torch.Tensor  # [B] float32 (1 where greedy: never used, never divides by 0)
    top_k: torch.Tensor        # [B] int64, 0 = off
    top_p: torch.Tensor        # [B] float32
    seeded: torch.Tensor       # [B] bool: seeded sampling (sampling.seeded), never greedy
    seeds: torch.Tensor        # [B] int64 (sampling.seed_tensor); 0 where not seeded

    @classmethod
    def from_params(cls, params: list[SamplingParams | None], device) -> "SamplingTensors":
        """One entry per bucket row; None = a padded row (greedy)."""
        greedy = [p is None or p.greedy for p in params]
        coupled = [p is not None and seeded(p) for p in params]
        return cls(torch.tensor(greedy, device=device),
                   torch.tensor([1.0 if g else p.temperature for g, p in zip(greedy, params)], device=device),
                   torch.tensor([0 if p is None else p.top_k for p in params], device=device),
                   torch.tensor([1.0 if p is None else p.top_p for p in params], device=device),
                   torch.tensor(coupled, device=device),
                   seed_tensor([p.seed if c else 0 for c, p in zip(coupled, params)], device))


def truncates(params: list[SamplingParams | None], vocab_size: int) -> bool:
    """Whether some sampled row truncates its distribution over `vocab_size` tokens
    (SamplingParams.truncates: top-k below V, or top-p < 1): a host-side choice of the graph
    variant, made from the rows' parameters like `sampled` and `seeded`."""
    return any(p is not None and p.truncates(vocab_size) for p in params)


def warp(logits: torch.Tensor, s: SamplingTensors, *, truncated: bool = True) -> torch.Tensor:
    """logits [B, T, V] → probabilities [B, T, V]: `sampling.target_probs` with per-row parameters
    (temperature, then top-k, then top-p, with the same tie and keep-at-least-one rules).
    truncated=False (no row has top-k or top-p: `truncates`) skips the two vocabulary sorts, which
    then change nothing: they cost 0.6 s of a 16-row, 9-position verify on a 2-core CPU (V = 49 152)."""
    B, T, V = logits.shape
    x = logits.float() / s.temperature[:, None, None]
    if not truncated:
        return x.softmax(-1)
    k = torch.where(s.top_k > 0, s.top_k.clamp(max=V), V)  # [B]; off = keep all V
    kth = x.sort(-1, descending=True).values.gather(-1, (k - 1)[:, None, None].expand(B, T, 1))
    x = x.masked_fill(x < kth, float("-inf"))
    # top-p: drop the least likely tokens whose mass stays within 1 - top_p; top_p = 1 drops
    # only zero-probability tokens, so applying it unconditionally changes nothing.
    sorted_x, order = torch.sort(x, dim=-1)
    cum = sorted_x.softmax(-1).cumsum(-1)
    drop_sorted = cum <= (1 - s.top_p)[:, None, None]
    drop_sorted[..., -1] = False
    x = x.masked_fill(drop_sorted.scatter(-1, order, drop_sorted), float("-inf"))
    return x.softmax(-1)


def step_noise(seeds: torch.Tensor, lengths: torch.Tensor, K: int, vocab: int) -> torch.Tensor:
    """seeds [B], lengths [B] (the pending tokens' indices) → Gumbel noise [B, K+1, V] of the
    sequence indices lengths + 1 + t that verify row t (and draft step t) predicts."""
    positions = lengths[:, None] + 1 + torch.arange(K + 1, device=lengths.device)[None]  # [B, K+1]
    return gumbel_noise(seeds, positions, vocab)


def draw(dist: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """Inverse-CDF draw: dist [B, V] (non-negative, any positive total), u [B] in (0, 1] → [B].
    The first index whose CDF reaches u·total; zero-probability tokens are never picked (u > 0)."""
    cdf = dist.cumsum(-1)
    return (cdf < (u * cdf[:, -1])[:, None]).sum(-1).clamp(max=dist.shape[-1] - 1)


def uniforms_for(generators: list[torch.Generator | None], n: int, device) -> torch.Tensor:
    """[B, n] in (0, 1], drawn on the host side of the step from each row's own generator (so a
    seeded request draws the same numbers whatever batch it runs in); greedy rows get ones."""
    rows = [torch.ones(n, device=device) if g is None
            else 1.0 - torch.rand(n, generator=g, device=g.device).to(device) for g in generators]
    return torch.stack(rows) if rows else torch.ones(0, n, device=device)


# -- acceptance -----------------------------------------------------------------------------------

@dataclass
class Acceptance:
    emitted: torch.Tensor  # [B, K+1] accepted drafted tokens, then the recovered / bonus one; 0 after
    counts: torch.Tensor   # [B] emitted tokens = accepted + 1


def _emit(drafted: torch.Tensor, accepted: torch.Tensor, final: torch.Tensor) -> Acceptance:
    B, K = drafted.shape
    out = torch.cat([drafted, drafted.new_zeros(B, 1)], 1)  # [B, K+1]
    out = out.scatter(1, accepted[:, None], final[:, None])
    cols = torch.arange(K + 1, device=out.device)[None]
    return Acceptance(torch.where(cols <= accepted[:, None], out, 0), accepted + 1)


def _live(draft_lens: torch.Tensor, K: int) -> torch.Tensor:
    return torch.arange(K, device=draft_lens.device)[None] < draft_lens[:, None]  # [B, K]


def greedy_acceptance(logits: torch.Tensor, tokens: torch.Tensor, draft_lens: torch.Tensor) -> Acceptance:
    """logits [B, K+1, V], tokens [B, K+1] (pending, drafted…) → the target's greedy continuation."""
    return chosen_acceptance(logits.argmax(-1), tokens, draft_lens)


def chosen_acceptance(best: torch.Tensor, tokens: torch.Tensor, draft_lens: torch.Tensor) -> Acceptance:
    """best [B, K+1]: the target's own token after each row (argmax, or the coupled sample of a
    seeded row) → drafted tokens accepted while they equal it, then the target's token."""
    drafted, K = tokens[:, 1:], tokens.shape[1] - 1
    match = _live(draft_lens, K) & (drafted == best[:, :K])
    accepted = match.long().cumprod(-1).sum(-1)  # [B]
    return _emit(drafted, accepted, best.gather(1, accepted[:, None])[:, 0])


def sampled_accepted(probs: torch.Tensor, tokens: torch.Tensor, draft_lens: torch.Tensor,
                     draft_probs: torch.Tensor | None, uniforms: torch.Tensor) -> torch.Tensor:
    """Accepted drafted tokens per row [B]: position j passes when u_j · q_j(x_j) < p_j(x_j)
    (probability min(1, p/q)); the count is the run of passes from the start."""
    drafted, K = tokens[:, 1:], tokens.shape[1] - 1
    px = probs[:, :K].gather(-1, drafted[..., None])[..., 0]  # [B, K]
    qx = torch.ones_like(px) if draft_probs is None else draft_probs.gather(-1, drafted[..., None])[..., 0]
    ok = _live(draft_lens, K) & (qx > 0) & (uniforms[:, :K] * qx < px)
    return ok.long().cumprod(-1).sum(-1)


def final_distribution(probs: torch.Tensor, tokens: torch.Tensor, draft_lens: torch.Tensor,
                       draft_probs: torch.Tensor | None, accepted: torch.Tensor) -> torch.Tensor:
    """[B, V] the distribution of the token after the accepted run: the normalised residual
    max(p − q, 0) where a drafted token was rejected, the target's p for the bonus token."""
    B, T, V = probs.shape
    K = T - 1
    p = probs.gather(1, accepted[:, None, None].expand(B, 1, V))[:, 0]  # [B, V]
    if K == 0:
        return p
    at = accepted.clamp(max=K - 1)[:, None]  # the rejected position (clamped when all passed)
    if draft_probs is None:  # point masses: q is one-hot at the drafted token
        q = torch.zeros_like(p).scatter(1, tokens[:, 1:].gather(1, at), 1.0)
    else:
        q = draft_probs.gather(1, at[..., None].expand(B, 1, V))[:, 0].float()
    residual = (p - q).clamp_min(0.0)
    total = residual.sum(-1, keepdim=True)
    # A zero residual means rejection had probability 0; only rounding gets here (as verify.py).
    residual = torch.where(total > 0, residual / torch.where(total > 0, total, 1.0), p)
    return torch.where((accepted < draft_lens)[:, None], residual, p)


def sampled_acceptance(probs: torch.Tensor, tokens: torch.Tensor, draft_lens: torch.Tensor,
                       draft_probs: torch.Tensor | None, uniforms: torch.Tensor) -> Acceptance:
    """probs [B, K+1, V] (warped target), draft_probs [B, K, V] or None, uniforms [B, K+1]."""
    accepted = sampled_accepted(probs, tokens, draft_lens, draft_probs, uniforms)
    dist = final_distribution(probs, tokens, draft_lens, draft_probs, accepted)
    K = tokens.shape[1] - 1
    return _emit(tokens[:, 1:], accepted, draw(dist, uniforms[:, K]))


def acceptance(logits: torch.Tensor, tokens: torch.Tensor, draft_lens: torch.Tensor,
               sampling: SamplingTensors, draft_probs: torch.Tensor | None, uniforms: torch.Tensor,
               *, sampled: bool, noise: torch.Tensor | None = None, truncated: bool = True) -> Acceptance:
    """Greedy rows by argmax, sampled rows by speculative sampling, seeded rows by the coupled
    sample (noise [B, K+1, V]), selected per row without a branch. `sampled` is a host-side
    choice of the graph variant: False when every row is greedy (then the vocabulary sorts of
    `warp` are skipped altogether); `noise` is None when no row is seeded; `truncated` False when
    no row has top-k or top-p (`truncates`: warp is then a tempered softmax)."""
    greedy = greedy_acceptance(logits, tokens, draft_lens)
    if not sampled:
        return greedy
    probs = warp(logits, sampling, truncated=truncated)
    spec = sampled_acceptance(probs, tokens, draft_lens, draft_probs, uniforms)
    g = sampling.greedy
    out = Acceptance(torch.where(g[:, None], greedy.emitted, spec.emitted), torch.where(g, greedy.counts, spec.counts))
    if noise is None:
        return out
    coupled = chosen_acceptance(coupled_choice(probs, noise), tokens, draft_lens)
    c = sampling.seeded
    return Acceptance(torch.where(c[:, None], coupled.emitted, out.emitted), torch.where(c, coupled.counts, out.counts))


# -- the target's step -------------------------------------------------------------------------------

@dataclass
class StepInputs:
    tokens: torch.Tensor                # [B, K+1] int64
    lengths: torch.Tensor               # [B] int64
    slots: torch.Tensor                 # [B] int64
    draft_lens: torch.Tensor            # [B] int64
    sampling: SamplingTensors
    uniforms: torch.Tensor              # [B, K+1] float32 in (0, 1]
    draft_probs: torch.Tensor | None = None  # [B, K, V]; None = point masses (argmax, n-gram)
    noise: torch.Tensor | None = None        # [B, K+1, V] seeded rows' Gumbel noise; None = no seeded row


@dataclass
class StepResult:
    emitted: torch.Tensor      # [B, K+1]
    counts: torch.Tensor       # [B] accepted + 1
    new_lengths: torch.Tensor  # [B] lengths + counts
    hidden: torch.Tensor       # [B, K+1, D] target features; the first counts[b] are committed
    # layer index → [B, K+1, D] residual stream after it, for the layers the step was asked to
    # keep (a drafter that fuses several target layers, EAGLE-3); {} when none
    layer_hidden: dict[int, torch.Tensor] = field(default_factory=dict)


def chain_batch(tokens: torch.Tensor, lengths: torch.Tensor, slots: torch.Tensor, span: int,
                sliding_window: int | None) -> ForwardBatch:
    """A chain of T new tokens per row at offsets `lengths`, attending over `span` cache entries.
    Cache entry s holds position s (chains commit in place), so query t of row b sees entries
    s ≤ lengths[b] + t: the committed ones and the chain up to itself; the rest is masked."""
    T = tokens.shape[1]
    positions = lengths[:, None] + torch.arange(T, device=tokens.device)[None]  # [B, T]
    keys = torch.arange(span, device=tokens.device)  # [S]
    mask = keys[None, None, :] <= positions[..., None]  # [B, T, S]
    if sliding_window:
        mask &= (positions[..., None] - keys) < sliding_window
    return ForwardBatch(tokens, positions, slots, lengths, mask)


def target_step(model: TargetModel, kv: DeviceKV, inp: StepInputs, span: int, *, sampled: bool,
                hidden_layers: tuple[int, ...] = (), truncated: bool = True) -> StepResult:
    """Verify forward + acceptance + commit for one bucket, keeping the residual streams after
    `hidden_layers` too (a fixed, host-side choice per proposer). Nothing here reads a device
    value on the host, so it can be captured as a CUDA graph (see specserve.core.cuda_graphs)."""
    batch = chain_batch(inp.tokens, inp.lengths, inp.slots, span, model.cfg.sliding_window)
    out = model.forward(batch, kv, hidden_layers=hidden_layers)  # hidden [B, K+1, D]
    logits = model.logits(out.hidden)  # [B, K+1, V] fp32
    acc = acceptance(logits, inp.tokens, inp.draft_lens, inp.sampling, inp.draft_probs, inp.uniforms,
                     sampled=sampled, noise=inp.noise, truncated=truncated)
    return StepResult(acc.emitted, acc.counts, inp.lengths + acc.counts, out.hidden, out.layer_hidden)


def to_host(*columns: torch.Tensor) -> torch.Tensor:
    """The step's one host sync: int tensors [B, n_i] or [B] → one CPU tensor [B, Σ n_i]."""
    return torch.cat([c if c.dim() == 2 else c[:, None] for c in columns], 1).cpu()


def check_static_model(model: TargetModel) -> None:
    """Refuse models whose forward needs a host decision (dynamic NTK RoPE reads positions)."""
    if model.cfg.rope.rope_type == "dynamic":
        raise ValueError("the static step (dspark) does not support dynamic NTK RoPE: its frequencies "
                         "depend on each row's length, read on the host; use eagle for this checkpoint")


# -- the engine's interface to a static-step method (DSPark) -------------------------------------------

@dataclass
class StaticRow:
    """What the engine hands a static-step proposer for one running sequence."""
    seq_id: int
    slot: int                       # the target's KV slot
    token_ids: list[int]            # prompt + emitted; the last one is pending (no KV yet)
    length: int                     # committed KV entries (the host's KVCache.lengths[slot])
    max_draft_len: int              # room: never draft past max_tokens or the model length
    params: SamplingParams
    generator: torch.Generator | None
    features: torch.Tensor | None   # [n, D] target features from the prefill (first step only)
    threshold: float | None         # the request's calibration threshold (None: the proposer's)
    seed: int | None = None         # a seeded sampled request's seed (generator is then None)


@dataclass
class StaticOutcome:
    emitted: list[int]   # accepted drafted tokens, then the recovered / bonus one
    num_drafted: int     # drafted tokens that counted (after the calibrated cut and the room)
    new_length: int      # committed KV entries after the step (apply with KVCache.truncate)
    width: int = 0       # K: the step's drafted width, verified for every row whatever its cut

    @property
    def num_accepted(self) -> int:
        return len(self.emitted) - 1
