"""Service tiers: read and validate a tiers file (config/tiers.yaml) against what one
server serves. Rendering the tier models is render.py's job; changing them on a running server
is tier_control.py's.

    tiers:
      - name: vip                 # → ensemble llm_vip, first step preprocess_vip
        method: dspark            # the tier's speculation method
        fallback: eagle           # runs instead: drafter unavailable, dflash's guard and gate
        priority: 9               # 0..9, higher is admitted first when the engine's slots are full
        proposer:
          max_draft_len: 6        # → the request's num_draft_tokens
          spec_threshold: 0.3     # → spec_threshold (calibration head's stop threshold)
          draft_policy: fixed     # adaptive | fixed
          dflash_text_types: [code]   # dflash tiers: text types that keep dflash (text_gate.py)
          block_size: 8           # dflash tiers: → dflash_block_size (drafts ≤ B - 1 per step)
          tree_budget: 16         # mtp tiers: → mtp_tree_budget
          proposers: [eagle, ngram]   # mtp tiers: → mtp_proposers
        limits:
          max_tokens: 512         # a request may ask for at most this many output tokens

A tier named `default` configures `llm` itself; without one, `llm` runs the server's defaults.

Merge order of a request's settings: the request's own sampling_parameters > its tier > the
server's defaults (serve's flags). A key the request does not set takes the tier's value; a key
neither sets stays unset and the engine applies the server's default. `limits.max_tokens` is a
limit, not a default: a request asking for more is refused with a message naming the tier; one
that does not say gets min(the server's default, the limit).

A bad file raises TierError naming the tier and the key, before any server starts.
"""

from __future__ import annotations

import json
import re
from dataclasses import asdict, dataclass, fields
from pathlib import Path
from typing import Any

from specserve.core.scheduling import MAX_PRIORITY
from specserve.methods import registry
from specserve.serving.schema import DEFAULT_TIER, TIER_NAME_PATTERN

PRIORITY_RANGE = (0, MAX_PRIORITY)   # admission.py: higher first, aged by steps waited
# Method settings: checked for type and range, refused on methods that do not use them, and
# handed to the method's requests as options (params.apply_tier).
BLOCK_SIZE_RANGE = (2, 16)     # dflash: block size B (→ dflash_block_size; drafts ≤ B - 1 per step;
                               # 16 = DFlashConfig.max_block_size)
TREE_BUDGET_RANGE = (1, 64)    # mtp: draft-tree nodes verified per step (→ mtp_tree_budget; the
                               # engine caps it at its max_draft_len)
# Each method declares its settings (methods/registry.py): key → the methods it applies to.
METHOD_SETTINGS = registry.tier_settings()

_TOP_KEYS = ("tiers",)
_TIER_KEYS = ("name", "method", "fallback", "priority", "proposer", "limits")
_PROPOSER_KEYS = ("max_draft_len", "spec_threshold", "draft_policy", *METHOD_SETTINGS)
_LIMIT_KEYS = ("max_tokens",)


class TierError(ValueError):
    """A tiers file the server cannot serve; the message names the tier and the key."""


@dataclass(frozen=True)
class ServerLimits:
    """What the server serves, that a tier is checked against."""
    methods: tuple[str, ...]            # methods this server runs (none, ngram, eagle, dspark …)
    max_draft_len: int
    max_model_len: int
    drafted: dict[str, str] | None = None   # method → the drafter method it needs (dspark → eagle)


@dataclass(frozen=True)
class Tier:
    name: str
    method: str
    # The tier's second choice: a request that runs the tier's method starts on this one instead
    # when, at admission, the method's proposer is unavailable (a remote drafter backing off
    # after failed calls; Engine._admit). Never switched mid-stream.
    fallback: str = "none"
    priority: int = 0
    max_draft_len: int | None = None      # → num_draft_tokens
    spec_threshold: float | None = None   # → spec_threshold
    draft_policy: str | None = None       # → draft_policy
    block_size: int | None = None
    tree_budget: int | None = None
    proposers: tuple[str, ...] | None = None
    # Text types whose requests keep dflash (text_gate.py); None → the server's --dflash-text-types.
    dflash_text_types: tuple[str, ...] | None = None
    max_tokens: int | None = None         # limit on the request's max_tokens

    def to_json(self) -> str:
        return json.dumps(asdict(self), sort_keys=True)

    @classmethod
    def from_json(cls, raw: str) -> "Tier":
        d = json.loads(raw)
        for key in ("proposers", "dflash_text_types"):
            if d.get(key) is not None:
                d[key] = tuple(d[key])
        return cls(**{f.name: d[f.name] for f in fields(cls) if f.name in d})


def default_tier() -> Tier:
    """`llm` when no tier named default is given: the server's defaults, nothing overridden."""
    return Tier(DEFAULT_TIER, method="", priority=0)


def known_methods() -> tuple[str, ...]:
    return registry.names()


def mtp_subproposers() -> tuple[str, ...]:
    return registry.member_names()


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _unknown_keys(where: str, got: dict, allowed: tuple[str, ...]) -> None:
    extra = [k for k in got if k not in allowed]
    if extra:
        raise TierError(f"{where}: unknown key(s) {', '.join(map(str, extra))}; allowed: {', '.join(allowed)}")


def _int_in(where: str, key: str, v: Any, lo: int, hi: int) -> int:
    if not _is_int(v) or not lo <= v <= hi:
        raise TierError(f"{where}: {key} must be an integer in [{lo}, {hi}], got {json.dumps(v)}")
    return v


def _check_method(where: str, key: str, method: Any, server: ServerLimits) -> str:
    known = known_methods()
    if not isinstance(method, str) or method not in known:
        raise TierError(f"{where}: {key} {json.dumps(method)} is unknown; methods: {', '.join(known)}")
    if method in server.methods:
        return method
    here = ", ".join(server.methods)
    need = (server.drafted or {}).get(method, method)
    raise TierError(f"{where}: {key} {method!r} needs a served {need} drafter, and this server serves none "
                    f"(serve it with --drafter {need}=DIR); available here: {here}")


def parse_tier(raw: Any, server: ServerLimits, index: int) -> Tier:
    if not isinstance(raw, dict):
        raise TierError(f"tiers[{index}] must be a mapping, got {json.dumps(raw)}")
    name = raw.get("name")
    if not isinstance(name, str) or not re.fullmatch(TIER_NAME_PATTERN, name):
        raise TierError(f"tiers[{index}]: name must match {TIER_NAME_PATTERN} (it becomes model names "
                        f"llm_<name>, preprocess_<name>), got {json.dumps(name)}")
    where = f"tier {name!r}"
    _unknown_keys(where, raw, _TIER_KEYS)
    if "method" not in raw:
        raise TierError(f"{where}: method is required")
    method = _check_method(where, "method", raw["method"], server)
    fallback = _check_method(where, "fallback", raw.get("fallback", "none"), server)
    priority = _int_in(where, "priority", raw.get("priority", 0), *PRIORITY_RANGE)

    prop = raw.get("proposer") or {}
    if not isinstance(prop, dict):
        raise TierError(f"{where}: proposer must be a mapping, got {json.dumps(prop)}")
    _unknown_keys(f"{where} proposer", prop, _PROPOSER_KEYS)
    got: dict[str, Any] = {}
    if "max_draft_len" in prop:
        got["max_draft_len"] = _int_in(where, "proposer.max_draft_len", prop["max_draft_len"], 0,
                                       server.max_draft_len)
    if "spec_threshold" in prop:
        th = prop["spec_threshold"]
        if not (_is_int(th) or isinstance(th, float)) or not 0.0 <= th <= 1.0:
            raise TierError(f"{where}: proposer.spec_threshold must be a number in [0, 1], got {json.dumps(th)}")
        got["spec_threshold"] = float(th)
    if "draft_policy" in prop:
        from specserve.core.draft_policy import POLICIES

        if prop["draft_policy"] not in POLICIES:
            raise TierError(f"{where}: proposer.draft_policy must be one of {', '.join(POLICIES)}, "
                            f"got {json.dumps(prop['draft_policy'])}")
        got["draft_policy"] = prop["draft_policy"]
    if "block_size" in prop:
        got["block_size"] = _int_in(where, "proposer.block_size", prop["block_size"], *BLOCK_SIZE_RANGE)
    if "tree_budget" in prop:
        got["tree_budget"] = _int_in(where, "proposer.tree_budget", prop["tree_budget"], *TREE_BUDGET_RANGE)
    if "proposers" in prop:
        ps = prop["proposers"]
        known = mtp_subproposers()
        if not isinstance(ps, list) or not ps or any(p not in known for p in ps):
            raise TierError(f"{where}: proposer.proposers must be a non-empty list of {', '.join(known)}, "
                            f"got {json.dumps(ps)}")
        got["proposers"] = tuple(ps)
    if "dflash_text_types" in prop:
        from specserve.serving.text_classifier import GateError, check_text_types

        try:
            got["dflash_text_types"] = check_text_types(prop["dflash_text_types"], "proposer.dflash_text_types")
        except GateError as e:
            raise TierError(f"{where}: {e}") from None
    for key, methods in METHOD_SETTINGS.items():
        if key in got and method not in methods:
            raise TierError(f"{where}: proposer.{key} applies to method {' / '.join(methods)} only, "
                            f"not {method!r}")

    limits = raw.get("limits") or {}
    if not isinstance(limits, dict):
        raise TierError(f"{where}: limits must be a mapping, got {json.dumps(limits)}")
    _unknown_keys(f"{where} limits", limits, _LIMIT_KEYS)
    if "max_tokens" in limits:
        got["max_tokens"] = _int_in(where, "limits.max_tokens", limits["max_tokens"], 1, server.max_model_len)
    return Tier(name, method, fallback, priority, **got)


def parse_tiers(doc: Any, server: ServerLimits) -> tuple[Tier, ...]:
    if not isinstance(doc, dict):
        raise TierError(f"a tiers file is a mapping with a 'tiers' list, got {type(doc).__name__}")
    _unknown_keys("tiers file", doc, _TOP_KEYS)
    raw = doc.get("tiers")
    if not isinstance(raw, list) or not raw:
        raise TierError("tiers file: 'tiers' must be a non-empty list")
    tiers, seen = [], set()
    for i, item in enumerate(raw):
        tier = parse_tier(item, server, i)
        if tier.name in seen:
            raise TierError(f"tier {tier.name!r}: name is used twice (tiers[{i}] repeats it)")
        seen.add(tier.name)
        tiers.append(tier)
    return tuple(tiers)


def load_tiers(path: Path, server: ServerLimits) -> tuple[Tier, ...]:
    import yaml

    try:
        doc = yaml.safe_load(Path(path).read_text())
    except OSError as e:
        raise TierError(f"cannot read tiers file {path}: {e.strerror}") from None
    except yaml.YAMLError as e:
        raise TierError(f"tiers file {path} is not valid YAML: {e}") from None
    return parse_tiers(doc, server)
