"""Sampling parameters and the target distribution they define.

Temperature, top-k and top-p shape the TARGET distribution (in that order, as transformers does);
speculative verification then reproduces exactly that distribution. `temperature == 0` means
greedy: the argmax of the raw logits.

Seeded sampling (a sampled request with a `seed`) draws no random stream. The token at sequence
index i is the Gumbel-max sample argmax_v(log p~_i(v) + g(seed, i, v)) over the warped target
distribution p~_i, with g a Gumbel variable computed from a hash of (seed, i, v): a counter-based
generator, so the token at each position depends on the seed and the prefix only, not on how many
draws earlier steps took (which depends on the method, the draft length and the load). Drafters
propose argmax(log q + g) with the same noise, and a drafted token is accepted exactly when it
equals the target's token (drafter-invariant speculative sampling, Daliri et al. 2024).
"""

from __future__ import annotations

import torch

from specserve.core.sampling_params import SamplingParams  # noqa: F401 — re-exported (every caller imports it from here)


def make_generator(params: SamplingParams, device: str | torch.device = "cpu") -> torch.Generator:
    g = torch.Generator(device=device)
    if params.seed is None:
        g.seed()
    else:
        g.manual_seed(params.seed)
    return g


def seeded(params: SamplingParams) -> bool:
    """The request samples with per-position noise from its seed (not a generator stream)."""
    return params.seed is not None and not params.greedy


# -- the counter-based noise: splitmix64 in int64 tensor ops (wrapping multiply, logical shifts) ------

def _signed(c: int) -> int:
    """An unsigned 64-bit constant as the int64 with the same bits."""
    return c - (1 << 64) if c >= 1 << 63 else c


_GOLDEN = _signed(0x9E3779B97F4A7C15)
_MIX1 = _signed(0xBF58476D1CE4E5B9)
_MIX2 = _signed(0x94D049BB133111EB)


def _shr(z: torch.Tensor, s: int) -> torch.Tensor:
    """Logical right shift of int64 bits (torch's >> is arithmetic on negative values)."""
    return (z >> s) & ((1 << (64 - s)) - 1)


def _mix(z: torch.Tensor) -> torch.Tensor:
    """splitmix64's finaliser: a bijection of 64-bit words whose outputs pass BigCrush."""
    z = (z ^ _shr(z, 30)) * _MIX1
    z = (z ^ _shr(z, 27)) * _MIX2
    return z ^ _shr(z, 31)


def seed_tensor(seeds: list[int], device: str | torch.device = "cpu") -> torch.Tensor:
    """Seeds in [0, 2^64) → int64 [N] with the same bits."""
    return torch.tensor([_signed(int(s)) for s in seeds], dtype=torch.long, device=device)


def gumbel_noise(seeds: torch.Tensor, positions: torch.Tensor, vocab: int) -> torch.Tensor:
    """seeds int64 [N] (seed_tensor), positions int64 [N, T] (absolute sequence indices)
    → standard Gumbel noise [N, T, V] float32, a pure function of (seed, position, token id).
    Each key is hashed in three levels: seed → per-request key, + position → per-position key,
    + token id → 64 random bits, of which the top 53 make a uniform u in (0, 1); g = −log(−log u)."""
    k = _mix(seeds + _GOLDEN)                                     # [N]
    k = _mix(k[:, None] + (positions + 1) * _GOLDEN)              # [N, T]
    ids = torch.arange(1, vocab + 1, dtype=torch.long, device=positions.device) * _GOLDEN  # [V]
    bits = _mix(k[..., None] + ids)                               # [N, T, V]
    u = (_shr(bits, 11).double() + 0.5) * 2.0 ** -53              # (0, 1), never 0 or 1
    return (-torch.log(-torch.log(u))).float()


def coupled_choice(probs: torch.Tensor, noise: torch.Tensor) -> torch.Tensor:
    """probs [..., V] (zeros allowed: never chosen), noise [..., V] → argmax(log p + g) [...]:
    a sample of probs when the noise is fresh Gumbel noise."""
    return (probs.log() + noise).argmax(-1)


def seeded_tokens(logits: torch.Tensor, params: SamplingParams, positions: list[int]) -> list[int]:
    """logits [N, V] of one seeded request predicting sequence indices `positions` [N] → the N
    tokens argmax(log p~ + g(seed, position)): the target's tokens, or a drafter's proposals."""
    probs = target_probs(logits, params)  # [N, V]
    pos = torch.tensor(positions, dtype=torch.long, device=logits.device)[None]  # [1, N]
    noise = gumbel_noise(seed_tensor([params.seed], logits.device), pos, probs.shape[-1])[0]  # [N, V]
    return coupled_choice(probs, noise).tolist()


def target_probs(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """logits [N, V] → probabilities [N, V] of the warped target distribution (temperature > 0)."""
    if params.greedy:
        raise ValueError("greedy decoding has no sampling distribution; use argmax")
    x = logits.float() / params.temperature
    if params.top_k_cuts(x.shape[-1]):
        kth = torch.topk(x, params.top_k, dim=-1).values[..., -1:]  # [N, 1]
        x = x.masked_fill(x < kth, float("-inf"))
    if params.top_p < 1.0:
        # Keep the smallest set of most likely tokens whose mass reaches top_p (at least one).
        sorted_x, order = torch.sort(x, dim=-1, descending=False)
        cum = sorted_x.softmax(-1).cumsum(-1)
        drop_sorted = cum <= (1 - params.top_p)
        drop_sorted[..., -1] = False
        drop = drop_sorted.scatter(-1, order, drop_sorted)
        x = x.masked_fill(drop, float("-inf"))
    probs = x.softmax(-1)
    # A row that is not a distribution (NaN / inf from a value validate() should have refused)
    # must fail its own request with a message, not torch.multinomial's, which names no field.
    if not bool(torch.isfinite(probs).all()):
        raise ValueError("the sampling parameters give an invalid probability distribution "
                         "(check temperature, top_p, top_k)")
    return probs


def sample(probs: torch.Tensor, generator: torch.Generator) -> int:
    """One draw from probs [V]."""
    return int(torch.multinomial(probs, 1, generator=generator))
