"""draft_drafter: the draft model with its KV cache per sequence (specserve.proposers.
remote_mtp_drafters.DraftModelService, the fused DraftModelProposer's code). One instance, so a
sequence's cache is always here. Its version folder holds the draft model's folder (config.json,
model.safetensors, tokenizer files); the target's checkpoint (a parameter) is read only for the
tokenizer check and the vocabulary size.

A request either drafts (seq_ids, context_tokens, max_draft_len) or releases finished sequences
(release_ids alone; answered with empty outputs).
"""

from pathlib import Path

import numpy as np
import torch
import triton_python_backend_utils as pb_utils

from specserve.methods.mtp.remote_drafters import DraftModelService, load_remote_draft
from specserve.triton import pb
from specserve.serving import schema

DRAFT_INPUTS = (schema.SEQ_IDS.name, schema.CONTEXT_TOKENS.name, schema.MAX_DRAFT_LEN.name)
SPECS = {t.name: t for t in schema.DRAFT_DRAFTER.inputs}
# Optional: without them every row drafts greedily (row_sampling.decode).
SAMPLING_INPUTS = tuple(t.name for t in schema.ROW_SAMPLING)


def _outputs(tokens, lps):
    return pb_utils.InferenceResponse(output_tensors=[
        pb_utils.Tensor(schema.DRAFT_MODEL_TOKENS.name, np.ascontiguousarray(tokens, dtype=np.int64)),
        pb_utils.Tensor(schema.DRAFT_MODEL_LOGPROBS.name, np.ascontiguousarray(lps, dtype=np.float32))])


class TritonPythonModel:
    def initialize(self, args):
        p = pb.model_parameters(args)
        # One thread: a draft step is small, and more threads fight the target's for the cores.
        torch.set_num_threads(1)
        folder = Path(args["model_repository"]) / args["model_version"] / "draft"
        if not (folder / "config.json").is_file():
            raise FileNotFoundError(f"draft_drafter: {folder} holds no draft model")
        draft = load_remote_draft(folder, p["checkpoint"], dtype=p["drafter_dtype"], device=p["device"])
        self.service = DraftModelService(draft, max_num_seqs=int(p["max_num_seqs"]),
                                         max_model_len=int(p["max_model_len"]), max_draft_len=int(p["max_draft_len"]))

    def execute(self, requests):
        responses = []
        for request in requests:
            try:
                release, arrays = pb.release_or_inputs(request, SPECS, DRAFT_INPUTS, "draft_drafter")
                if release is not None:
                    self.service.release(release)
                    responses.append(_outputs(np.zeros((0, 0)), np.zeros((0, 0))))
                    continue
                sampling = (pb.input_array(request, SPECS[n]) for n in SAMPLING_INPUTS)
                responses.append(_outputs(*self.service.chains(*arrays.values(), *sampling)))
            except Exception as e:  # noqa: BLE001 — answer this request with the error, keep serving
                responses.append(pb.error_response(f"draft_drafter: {e}"))
        return responses
