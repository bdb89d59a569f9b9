"""The method registry: every speculation method declares itself once, here.

Each method's folder has a `spec.py` whose MethodSpec says what the method drafts with, where it
may run, which step it uses, its per-request options, its tier settings, the Triton models its
remote placement needs, its capabilities and how it is built. Everything that lists or treats
methods differently (the engine builder, the renderer, request parsing, tiers, the CLI, the
schema's mtp members) reads this registry; a conformance test checks each spec against the
proposer its builder makes, so the two cannot drift apart.

Adding a method: its folder with a proposer and a `spec.py` whose SPEC = register(MethodSpec(...))
with its builder, and its module in SPEC_MODULES below (whose order is the order methods are
listed in).

    from specserve.methods import registry
    registry.get("dflash").capabilities.repetition_guarded   # True
    registry.names()                                          # ("none", "ngram", "eagle", …)
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Callable, Literal, Mapping, Optional

if TYPE_CHECKING:
    import torch

    from specserve.core.proposer import AnyProposer, RemoteCalls

# What a method drafts with: nothing (no weights: none, ngram), a drafter folder of its own
# (`--drafter METHOD=DIR`), another method's drafter (dspark runs eagle's), or the drafts of other
# methods merged (mtp; it may also have a folder of its own for a member: the MTP heads).
DraftsWith = Literal["nothing", "own", "other", "composite"]
PLACEMENTS = ("fused", "remote")
STEPS = ("dynamic", "static")

# The methods, in listing order: one module per method, each registering its MethodSpec.
SPEC_MODULES = (
    "specserve.methods.none.spec",
    "specserve.methods.ngram.spec",
    "specserve.methods.eagle.spec",
    "specserve.methods.dflash.spec",
    "specserve.methods.draft.spec",
    "specserve.methods.dspark.spec",
    "specserve.methods.mtp.spec",
)


@dataclass(frozen=True)
class OptionSpec:
    """A per-request option (a sampling_parameters key, handed to the proposer as
    DraftRequest.options). Its JSON type is checked by request parsing, its meaning by the
    proposer's check_options."""
    key: str
    kind: Literal["an integer", "a list of strings"]
    # The tiers file's `proposer.<tier_setting>` that sets it for the tier's requests.
    tier_setting: str | None = None


@dataclass(frozen=True)
class Member:
    """A member of a composite method: a drafter whose drafts the composite merges."""
    name: str                            # as the composite names it (mtp_proposers, sources)
    drafter: str | None                  # the method whose drafter folder it needs; None: none
    triton_models: tuple[str, ...] = ()  # its models in the composite's remote ensemble


@dataclass(frozen=True)
class MethodCapabilities:
    """What a method's proposers declare (core/proposer.py Capabilities); checked against them."""
    needs_features: bool = False
    feature_layers: bool = False      # reads target residual streams besides the final hidden state
    repetition_guarded: bool = False  # steps aside to a fallback while the output repeats
    text_gated: bool = False          # the text-type gate (serving/text_gate.py) decides per request

    @property
    def may_be_fallback(self) -> bool:
        """A guarded method never stands in for another (its own guard would need a fallback)."""
        return not self.repetition_guarded


@dataclass(frozen=True)
class BuildContext:
    """What a method's builder gets: the deployment's settings that proposers read, the target,
    the drafter folder, and the proposers built before it (a composite's members, a borrowed
    drafter)."""
    model: object                       # the target Transformer
    checkpoint: Path
    folder: str | None                  # the method's drafter folder (None: it has none)
    drafters: tuple[tuple[str, str], ...]   # every served (method, folder)
    built: Mapping[str, "AnyProposer"]
    max_num_seqs: int
    max_model_len: int
    max_draft_len: int
    spec_threshold: float | None
    drafter_dtype: "torch.dtype"
    block_size: int | None
    placement: str                      # the placement this method runs in
    remote: "RemoteCalls | None"        # None: built in process, no Triton to call
    remote_timeout_s: float             # a remote drafter call waited for at most this


@dataclass(frozen=True)
class MethodSpec:
    name: str
    drafts_with: DraftsWith = "nothing"
    drafter_of: str | None = None            # drafts_with "other": the method whose drafter it runs
    members: tuple[Member, ...] = ()          # drafts_with "composite", in tie-break order
    placements: tuple[str, ...] = ("fused",)
    remote_needs: tuple[str, ...] = ()        # methods whose served drafters its remote placement needs
    step: str = "dynamic"                     # "static": a StaticStepProposer (the whole step is one graph)
    options: tuple[OptionSpec, ...] = ()
    # tiers file proposer.<key>s that apply to it only, besides its options' tier settings
    tier_settings: tuple[str, ...] = ()
    triton_models: tuple[str, ...] = ()       # the models its remote placement needs
    # config.json `specserve_drafter` values its drafter folder may hold (empty: its name only).
    # eagle takes both layouts: "eagle" (EAGLE-1) and "eagle3" (fused layers, reduced vocabulary).
    folder_kinds: tuple[str, ...] = ()
    capabilities: MethodCapabilities = field(default_factory=MethodCapabilities)
    # Makes the proposer from a BuildContext; it imports the proposer's module when called, so
    # reading the registry loads no torch module. None: built into the engine (none).
    builder: Optional[Callable[[BuildContext], "AnyProposer"]] = field(default=None, compare=False)

    def __post_init__(self) -> None:
        if self.step not in STEPS or any(p not in PLACEMENTS for p in self.placements):
            raise ValueError(f"method {self.name}: step must be one of {STEPS}, placements of {PLACEMENTS}")
        if (self.drafts_with == "other") != (self.drafter_of is not None):
            raise ValueError(f"method {self.name}: drafter_of is for drafts_with 'other' only")
        if (self.drafts_with == "composite") != bool(self.members):
            raise ValueError(f"method {self.name}: members are for drafts_with 'composite' only")

    @property
    def option_keys(self) -> tuple[str, ...]:
        return tuple(o.key for o in self.options)

    @property
    def takes_folder(self) -> bool:
        """Whether `--drafter NAME=DIR` names a folder of this method (its own drafter, or a
        composite member that needs the composite's own folder)."""
        return self.drafts_with == "own" or any(m.drafter == self.name for m in self.members)

    @property
    def drafter_kinds(self) -> tuple[str, ...]:
        """The `specserve_drafter` values a folder of this method is recognised by."""
        return self.folder_kinds or (self.name,)

    @property
    def fused_only(self) -> bool:
        return self.placements == ("fused",)

    def build(self, ctx: BuildContext) -> "AnyProposer":
        if self.builder is None:
            raise ValueError(f"method {self.name} is built into the engine")
        return self.builder(ctx)

    @property
    def own_tier_settings(self) -> tuple[str, ...]:
        return (*(o.tier_setting for o in self.options if o.tier_setting), *self.tier_settings)


_SPECS: dict[str, MethodSpec] = {}
_loaded = False


def register(spec: MethodSpec) -> MethodSpec:
    """Called once by each method's spec module."""
    if spec.name in _SPECS and _SPECS[spec.name] != spec:
        raise ValueError(f"method {spec.name!r} is registered twice")
    _SPECS[spec.name] = spec
    return spec


def _load() -> dict[str, MethodSpec]:
    global _SPECS, _loaded
    if not _loaded:
        # A spec module imported earlier (a proposer reading its own spec) registered out of
        # turn: the listing order is SPEC_MODULES'.
        order = [importlib.import_module(module).SPEC.name for module in SPEC_MODULES]
        _SPECS = {name: _SPECS[name] for name in order} | _SPECS
        _loaded = True
    return _SPECS


def specs() -> tuple[MethodSpec, ...]:
    return tuple(_load().values())


def names() -> tuple[str, ...]:
    return tuple(_load())


def get(name: str) -> MethodSpec:
    try:
        return _load()[name]
    except KeyError:
        raise ValueError(f"unknown method {name!r}; methods: {', '.join(names())}") from None


# -- predicates over the registry (what callers used to keep as lists) ----------------------------
def with_drafts(kind: DraftsWith) -> tuple[str, ...]:
    return tuple(s.name for s in specs() if s.drafts_with == kind)


def folder_methods() -> tuple[str, ...]:
    """Methods `--drafter METHOD=DIR` may name: those with a drafter of their own, then the
    composites whose members need their folder."""
    own = [s.name for s in specs() if s.drafts_with == "own"]
    return (*own, *(s.name for s in specs() if s.takes_folder and s.name not in own))


def guarded() -> tuple[str, ...]:
    return tuple(s.name for s in specs() if s.capabilities.repetition_guarded)


def gated_method() -> str:
    """The method the text-type gate acts on (exactly one)."""
    (name,) = (s.name for s in specs() if s.capabilities.text_gated)
    return name


def option_keys() -> tuple[str, ...]:
    return tuple(o.key for s in specs() for o in s.options)


def option(key: str) -> tuple[MethodSpec, OptionSpec]:
    """The method that takes option `key`, and its declaration."""
    return next((s, o) for s in specs() for o in s.options if o.key == key)


def tier_settings() -> dict[str, tuple[str, ...]]:
    """tiers file proposer.<key> → the methods it applies to: first those that set a request
    option, then the others."""
    out: dict[str, tuple[str, ...]] = {}
    keys = [(o.tier_setting, s.name) for s in specs() for o in s.options if o.tier_setting]
    for key, method in keys + [(k, s.name) for s in specs() for k in s.tier_settings]:
        out[key] = (*out.get(key, ()), method)
    return out


def borrowed() -> dict[str, str]:
    """method → the method whose drafter it runs (dspark → eagle)."""
    return {s.name: s.drafter_of for s in specs() if s.drafts_with == "other"}


def composite() -> MethodSpec:
    """The composite method (mtp)."""
    (spec,) = (s for s in specs() if s.drafts_with == "composite")
    return spec


def member_names() -> tuple[str, ...]:
    return tuple(m.name for m in composite().members)


def served_members(drafters: tuple[tuple[str, str], ...]) -> tuple[str, ...]:
    """The composite's members a deployment with these drafters serves (in its order)."""
    served = {m for m, _ in drafters}
    return tuple(m.name for m in composite().members if m.drafter is None or m.drafter in served)
