"""The tensor I/O schema of every model in the repository, defined once.

The renderer writes each `config.pbtxt` from these specs, and the model adapters read and write
tensors by these names and dtypes; nothing else spells a tensor name. The ensemble `llm` follows
Triton's vLLM backend (text_input / stream / sampling_parameters / exclude_input_in_output in,
text_output / num_input_tokens / num_output_tokens / finish_reason out) plus our `spec_stats`.

    client ─▶ llm (ensemble)
                preprocess       ENSEMBLE_INPUTS → input_ids, request_config
                target_verifier  input_ids, request_config → token_window, read_offset, flush, response_meta
                                 (decoupled: one response per engine output of the request)
                postprocess      token_window, read_offset, flush, response_meta → ENSEMBLE_OUTPUTS

Every internal tensor name is unique across the ensemble, so a step's input_map / output_map maps
each name to itself.

Internal calls (see auth.py): preprocess signs (input_ids, request_config) into `signature`;
cancel_request_id and control requests carry `internal_key`. Clients never see either key.

Cancellation: Triton 2.51 does not pass an ensemble request's cancellation to a step already in
flight (target_verifier), only to steps scheduled after it. So postprocess, which is scheduled
for every streamed response, is the one that sees it; it then sends target_verifier a request
carrying only `cancel_request_id` (BLS), which cancels the engine request and frees its slot.
That is why target_verifier's other inputs are optional.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import numpy as np

from specserve.methods import registry


@dataclass(frozen=True)
class TensorSpec:
    name: str
    dtype: str                 # Triton's type name without the TYPE_ prefix
    dims: tuple[int, ...]
    optional: bool = False

    @property
    def numpy_dtype(self) -> type:
        return _NUMPY[self.dtype]


_NUMPY = {"STRING": np.object_, "BOOL": np.bool_, "INT64": np.int64, "INT32": np.int32,
          "UINT32": np.uint32, "FP32": np.float32, "FP64": np.float64}

# -- the ensemble (what users call) --------------------------------------------------------------
# Required, but declared optional: Triton 2.51's ensemble answers a request that lacks a required
# input with an empty final response instead of an error, so preprocess checks for it instead.
TEXT_INPUT = TensorSpec("text_input", "STRING", (1,), optional=True)
STREAM = TensorSpec("stream", "BOOL", (1,), optional=True)
SAMPLING_PARAMETERS = TensorSpec("sampling_parameters", "STRING", (1,), optional=True)  # JSON object
EXCLUDE_INPUT_IN_OUTPUT = TensorSpec("exclude_input_in_output", "BOOL", (1,), optional=True)

TEXT_OUTPUT = TensorSpec("text_output", "STRING", (1,))
NUM_INPUT_TOKENS = TensorSpec("num_input_tokens", "UINT32", (1,))
# As the vLLM backend counts it: the output tokens of THIS response (streaming: the tokens it adds;
# otherwise all of them), so a client sums them.
NUM_OUTPUT_TOKENS = TensorSpec("num_output_tokens", "UINT32", (1,))
FINISH_REASON = TensorSpec("finish_reason", "STRING", (1,))   # "" until the final response
SPEC_STATS = TensorSpec("spec_stats", "STRING", (1,))         # JSON, cumulative for the request

# The vLLM backend's optional "additional outputs" switches, which Triton's OpenAI frontend
# sends. We always send finish_reason, num_input_tokens and num_output_tokens, so asking for them
# is accepted; we compute no log-probabilities, so asking for those is refused (preprocess.py).
RETURN_FINISH_REASON = TensorSpec("return_finish_reason", "BOOL", (1,), optional=True)
RETURN_CUMULATIVE_LOGPROB = TensorSpec("return_cumulative_logprob", "BOOL", (1,), optional=True)
RETURN_LOGPROBS = TensorSpec("return_logprobs", "BOOL", (1,), optional=True)
RETURN_NUM_INPUT_TOKENS = TensorSpec("return_num_input_tokens", "BOOL", (1,), optional=True)
RETURN_NUM_OUTPUT_TOKENS = TensorSpec("return_num_output_tokens", "BOOL", (1,), optional=True)
RETURN_FLAGS = (RETURN_FINISH_REASON, RETURN_CUMULATIVE_LOGPROB, RETURN_LOGPROBS, RETURN_NUM_INPUT_TOKENS,
                RETURN_NUM_OUTPUT_TOKENS)
UNSUPPORTED_RETURN_FLAGS = (RETURN_CUMULATIVE_LOGPROB, RETURN_LOGPROBS)

ENSEMBLE_INPUTS = (TEXT_INPUT, STREAM, SAMPLING_PARAMETERS, EXCLUDE_INPUT_IN_OUTPUT, *RETURN_FLAGS)
ENSEMBLE_OUTPUTS = (TEXT_OUTPUT, NUM_INPUT_TOKENS, NUM_OUTPUT_TOKENS, FINISH_REASON, SPEC_STATS)

# -- internal tensors ------------------------------------------------------------------------------
INPUT_IDS = TensorSpec("input_ids", "INT64", (-1,))
REQUEST_CONFIG = TensorSpec("request_config", "STRING", (1,))  # JSON of params.RequestConfig

# What postprocess needs to detokenize one response on its own (see detokenize.py): the last few
# already-sent token ids followed by the new ones, where the new ones start, and whether this is
# the final response (which flushes any held-back partial character).
TOKEN_WINDOW = TensorSpec("token_window", "INT64", (-1,))
READ_OFFSET = TensorSpec("read_offset", "INT32", (1,))
FLUSH = TensorSpec("flush", "BOOL", (1,))
RESPONSE_META = TensorSpec("response_meta", "STRING", (1,))    # JSON of detokenize.ResponseMeta
CANCEL_REQUEST_ID = TensorSpec("cancel_request_id", "STRING", (1,), optional=True)
# The request's signature from preprocess (see auth.py); carried beside request_config.
SIGNATURE = TensorSpec("signature", "STRING", (1,))
# Server-internal calls to target_verifier (postprocess's cancel, specserve serve's shutdown
# controls) carry the deployment's internal key; CONTROL is "drain" | "abort" | "status".
INTERNAL_KEY = TensorSpec("internal_key", "STRING", (1,), optional=True)
CONTROL = TensorSpec("control", "STRING", (1,), optional=True)
CONTROLS = ("drain", "abort", "status")


@dataclass(frozen=True)
class ModelSpec:
    name: str
    inputs: tuple[TensorSpec, ...]
    outputs: tuple[TensorSpec, ...]
    decoupled: bool = False


PREPROCESS = ModelSpec("preprocess", ENSEMBLE_INPUTS, (INPUT_IDS, REQUEST_CONFIG, SIGNATURE))
TARGET_VERIFIER = ModelSpec("target_verifier",
                            (replace(INPUT_IDS, optional=True), replace(REQUEST_CONFIG, optional=True),
                             replace(SIGNATURE, optional=True), CANCEL_REQUEST_ID, INTERNAL_KEY, CONTROL),
                            (TOKEN_WINDOW, READ_OFFSET, FLUSH, RESPONSE_META), decoupled=True)
POSTPROCESS = ModelSpec("postprocess", (TOKEN_WINDOW, READ_OFFSET, FLUSH, RESPONSE_META), ENSEMBLE_OUTPUTS)
ENSEMBLE = ModelSpec("llm", ENSEMBLE_INPUTS, ENSEMBLE_OUTPUTS)
ENSEMBLE_STEPS = (PREPROCESS, TARGET_VERIFIER, POSTPROCESS)

# -- service tiers (specserve/serving/tiers.py) --------------------------------------------------------
# Each tier is one ensemble llm_<tier> whose first step is its own preprocess_<tier> (which carries
# the tier's settings as model parameters); target_verifier and postprocess are shared. The default
# tier is `llm` / `preprocess` themselves. Tier names become model names, hence the narrow alphabet.
DEFAULT_TIER = "default"
TIER_NAME_PATTERN = r"[a-z][a-z0-9_]{0,31}"


def tier_preprocess(tier: str) -> ModelSpec:
    return PREPROCESS if tier == DEFAULT_TIER else replace(PREPROCESS, name=f"{PREPROCESS.name}_{tier}")


def tier_ensemble(tier: str) -> ModelSpec:
    return ENSEMBLE if tier == DEFAULT_TIER else replace(ENSEMBLE, name=f"{ENSEMBLE.name}_{tier}")


def tier_steps(tier: str) -> tuple[ModelSpec, ...]:
    return (tier_preprocess(tier), TARGET_VERIFIER, POSTPROCESS)


def tier_of_preprocess(model_name: str) -> str | None:
    """The tier a preprocess model serves (None: not a preprocess model)."""
    if model_name == PREPROCESS.name:
        return DEFAULT_TIER
    prefix = f"{PREPROCESS.name}_"
    return model_name[len(prefix):] if model_name.startswith(prefix) else None


# -- remote drafters (hot-loadable; called by target_verifier through BLS) ---------------------------
# eagle_proposal = ensemble(eagle_backbone → calibration_head). The engine sends, per row, the
# sequence id, how many drafter pairs it believes the drafter holds, the new pairs (true target
# features and the tokens that follow them), the draft budget and the row's sampling; it gets back
# draft tokens (greedy, or for a seeded row argmax(log q~ + g(seed, position)) with the target's
# noise: core/sampling.py) and each position's predicted acceptance probability. See
# specserve/methods/eagle/onnx_runtime.py.
SEQ_IDS = TensorSpec("seq_ids", "INT64", (-1,))
VALID_FROM = TensorSpec("valid_from", "INT64", (-1,))
NUM_NEW = TensorSpec("num_new", "INT64", (-1,))
FEATURES = TensorSpec("features", "FP32", (-1, -1, -1))
NEXT_TOKENS = TensorSpec("next_tokens", "INT64", (-1, -1))
MAX_DRAFT_LEN = TensorSpec("max_draft_len", "INT64", (-1,))
DRAFT_TOKENS = TensorSpec("draft_tokens", "INT64", (-1, -1))
DRAFT_HIDDEN = TensorSpec("draft_hidden", "FP32", (-1, -1, -1))
DRAFT_SCALARS = TensorSpec("draft_scalars", "FP32", (-1, -1, 3))
# log q(draft token) per position: remote mtp's arbiter scores EAGLE's chain by it, as fused mtp
# scores the fused drafter's (a seeded row's token need not be q's top-1).
DRAFT_LOGPROBS = TensorSpec("draft_logprobs", "FP32", (-1, -1))
UNKNOWN = TensorSpec("unknown", "BOOL", (-1,))
ACCEPT_PROB = TensorSpec("accept_prob", "FP32", (-1, -1))
RELEASE_IDS = TensorSpec("release_ids", "INT64", (-1,), optional=True)
# Each row's sampling, for drafters that propose with a seeded row's noise: temperature 0 for
# rows that draft greedily (greedy and unseeded requests); the seed's 64 bits as an int64
# (sampling.seed_tensor); float64 so the warped distribution is the engine's to the last bit.
ROW_SEED = TensorSpec("row_seed", "INT64", (-1,))
ROW_TEMPERATURE = TensorSpec("row_temperature", "FP64", (-1,))
ROW_TOP_K = TensorSpec("row_top_k", "INT64", (-1,))
ROW_TOP_P = TensorSpec("row_top_p", "FP64", (-1,))
ROW_SAMPLING = (ROW_SEED, ROW_TEMPERATURE, ROW_TOP_K, ROW_TOP_P)

_DRAFT_IN = (SEQ_IDS, VALID_FROM, NUM_NEW, FEATURES, NEXT_TOKENS, MAX_DRAFT_LEN, *ROW_SAMPLING)
# eagle_backbone also takes release_ids alone (the engine frees a finished sequence's state), so
# its draft inputs are optional there and checked by the adapter.
EAGLE_BACKBONE = ModelSpec("eagle_backbone", tuple(replace(t, optional=True) for t in _DRAFT_IN) + (RELEASE_IDS,),
                           (DRAFT_TOKENS, DRAFT_HIDDEN, DRAFT_SCALARS, DRAFT_LOGPROBS, UNKNOWN))
CALIBRATION_HEAD = ModelSpec("calibration_head", (DRAFT_HIDDEN, DRAFT_SCALARS), (ACCEPT_PROB,))
EAGLE_PROPOSAL = ModelSpec("eagle_proposal", _DRAFT_IN, (DRAFT_TOKENS, ACCEPT_PROB, UNKNOWN))
EAGLE_PROPOSAL_STEPS = (EAGLE_BACKBONE, CALIBRATION_HEAD)

# mtp_proposal = ensemble(eagle_backbone → calibration_head ∥ mtp_heads ∥ draft_drafter ∥ ngram_drafter
# → mtp_arbiter): the drafters run in parallel and the arbiter merges their drafts into one tree per
# row (specserve/methods/mtp/remote.py). Besides EAGLE's inputs the engine sends each row's tokens
# (for n-gram lookup and the draft model), its tree budget, its proposer set (bit i =
# the mtp spec's member i) and its calibration threshold; it gets back a tree: tokens, parents
# (-1 = child of the pending token) and per node the proposers whose candidate passes through it
# (same bits), -1 padded. mtp_heads and draft_drafter are members only where their weights are
# served (render.render_mtp_proposal; MTP_DRAFTERS below).
CONTEXT_TOKENS = TensorSpec("context_tokens", "INT64", (-1, -1))   # [B, L], -1 padded
TREE_BUDGET = TensorSpec("tree_budget", "INT64", (-1,))
PROPOSER_MASK = TensorSpec("proposer_mask", "INT64", (-1,))
ROW_THRESHOLD = TensorSpec("row_threshold", "FP32", (-1,))          # 0: no calibration cut
NGRAM_TOKENS = TensorSpec("ngram_tokens", "INT64", (-1, -1))       # [B, K], -1 padded
# The MTP heads' and the draft model's chains, with the log-probability each gave its token
# (the fused proposers' Draft.probs read back as log q(token)); [B, K], -1 / 0 padded.
HEADS_TOKENS = TensorSpec("heads_tokens", "INT64", (-1, -1))
HEADS_LOGPROBS = TensorSpec("heads_logprobs", "FP32", (-1, -1))
DRAFT_MODEL_TOKENS = TensorSpec("draft_model_tokens", "INT64", (-1, -1))
DRAFT_MODEL_LOGPROBS = TensorSpec("draft_model_logprobs", "FP32", (-1, -1))
TREE_TOKENS = TensorSpec("tree_tokens", "INT64", (-1, -1))         # [B, N], -1 padded
TREE_PARENTS = TensorSpec("tree_parents", "INT64", (-1, -1))
TREE_SOURCES = TensorSpec("tree_sources", "INT64", (-1, -1))

NGRAM_DRAFTER = ModelSpec("ngram_drafter", (CONTEXT_TOKENS, MAX_DRAFT_LEN), (NGRAM_TOKENS,))
# Stateless: the last of each row's new feature rows is the target's f_t (features[b, num_new[b]-1]).
# valid_from and the rows' sampling (optional: without them every chain is greedy) place a seeded
# row's heads at their sequence indices, valid_from + num_new + 1 + j, for its noise.
MTP_HEADS = ModelSpec("mtp_heads", (FEATURES, NUM_NEW, MAX_DRAFT_LEN)
                      + tuple(replace(t, optional=True) for t in (VALID_FROM, *ROW_SAMPLING)),
                      (HEADS_TOKENS, HEADS_LOGPROBS))
# The draft model's KV cache per sequence (keyed by seq_ids), brought up to each row's
# context_tokens every call, so it needs no re-priming; release_ids alone frees sequences.
DRAFT_DRAFTER = ModelSpec("draft_drafter", tuple(replace(t, optional=True)
                                                for t in (SEQ_IDS, CONTEXT_TOKENS, MAX_DRAFT_LEN, *ROW_SAMPLING))
                          + (RELEASE_IDS,), (DRAFT_MODEL_TOKENS, DRAFT_MODEL_LOGPROBS))
TREE_SETTINGS = (TREE_BUDGET, PROPOSER_MASK, ROW_THRESHOLD)
# The drafters' outputs are optional: when the ensemble fails (a drafter unloaded), the engine
# calls the drafters that are still loaded one by one and the arbiter with what they returned.
MTP_ARBITER = ModelSpec("mtp_arbiter", tuple(replace(t, optional=True) for t in
                                             (DRAFT_TOKENS, DRAFT_SCALARS, DRAFT_LOGPROBS, ACCEPT_PROB, NGRAM_TOKENS, HEADS_TOKENS,
                                              HEADS_LOGPROBS, DRAFT_MODEL_TOKENS, DRAFT_MODEL_LOGPROBS))
                        + TREE_SETTINGS, (TREE_TOKENS, TREE_PARENTS, TREE_SOURCES))
MTP_PROPOSAL = ModelSpec("mtp_proposal", _DRAFT_IN + (CONTEXT_TOKENS,) + TREE_SETTINGS,
                         (TREE_TOKENS, TREE_PARENTS, TREE_SOURCES, UNKNOWN))
# Each mtp member (the mtp spec's, in its order) → its drafter models in mtp_proposal, in call
# order, named by the spec; a member is in the ensemble where it is served.
_DRAFTER_MODELS = {m.name: m for m in (MTP_HEADS, EAGLE_BACKBONE, CALIBRATION_HEAD, DRAFT_DRAFTER, NGRAM_DRAFTER)}
MTP_DRAFTERS: dict[str, tuple[ModelSpec, ...]] = {
    m.name: tuple(_DRAFTER_MODELS[n] for n in m.triton_models) for m in registry.composite().members}
# Every model mtp_proposal may have (what `specserve drafters` may load / unload).
MTP_PROPOSAL_STEPS = (*(m for models in MTP_DRAFTERS.values() for m in models), MTP_ARBITER)


def mtp_proposal_steps(served: tuple[str, ...] | list[str]) -> tuple[ModelSpec, ...]:
    """The ensemble's steps for the served sub-proposers (unknown names refused)."""
    unknown = [n for n in served if n not in MTP_DRAFTERS]
    if unknown:
        raise ValueError(f"mtp_proposal: no drafter models for {unknown}; known: {', '.join(MTP_DRAFTERS)}")
    return (*(m for n, models in MTP_DRAFTERS.items() if n in served for m in models), MTP_ARBITER)


# Every remote proposal model (hot-loadable through `specserve drafters`): the proposal ensemble
# and the models it is made of, registered once here; drafters.py and the renderer derive from it.
REMOTE_PROPOSALS: dict[str, tuple[ModelSpec, tuple[ModelSpec, ...]]] = {
    EAGLE_PROPOSAL.name: (EAGLE_PROPOSAL, EAGLE_PROPOSAL_STEPS),
    MTP_PROPOSAL.name: (MTP_PROPOSAL, MTP_PROPOSAL_STEPS),
}

# -- the text-type gate (specserve/serving/text_gate.py) ------------------------------------------------------
# text_classifier: a prompt → its text type and that type's probability. preprocess calls it by BLS
# for requests whose effective method is the gated one (dflash); hot-loadable (drafters.py).
GATE_TEXT = TensorSpec("gate_text", "STRING", (1,))
TEXT_TYPE = TensorSpec("text_type", "STRING", (1,))
TEXT_TYPE_PROB = TensorSpec("text_type_prob", "FP32", (1,))
TEXT_CLASSIFIER = ModelSpec("text_classifier", (GATE_TEXT,), (TEXT_TYPE, TEXT_TYPE_PROB))
