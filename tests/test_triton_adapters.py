"""The Triton adapters without a server: parameters, detokenization, rendering, launch helpers and
the verifier service driving a real tiny engine with fake response senders."""

from __future__ import annotations

import json
import random
import sys
import threading
import time
from pathlib import Path

import pytest
from google.protobuf import text_format

from conftest import make_served_checkpoint
from specserve.serving import schema
from specserve.serving.detokenize import TokenWindow, make_window, stable, text_delta
from specserve.serving.params import BadRequest, make_request_config, parse_sampling_parameters
from specserve.serving.settings import DeploymentSettings
from specserve.triton.render import render_repository
from specserve.core.engine import GenerationRequest
from specserve.model.transformer import CheckpointError
from specserve.core.sampling import SamplingParams


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return make_served_checkpoint(tmp_path_factory.mktemp("adapters_ckpt"), seed=3)


@pytest.fixture(scope="module")
def decode(ckpt):
    from specserve.model.tokenizer import load_tokenizer, make_decode
    return make_decode(load_tokenizer(ckpt))


# -- sampling_parameters -------------------------------------------------------------------------
def test_parse_sampling_parameters_accepts_the_known_keys():
    sampling, spec = parse_sampling_parameters(json.dumps(
        {"max_tokens": 5, "temperature": 1, "top_p": 0.5, "top_k": 3, "seed": 1, "stop": "x", "spec_method": "ngram",
         "num_draft_tokens": 4, "spec_threshold": 0}))
    assert sampling == {"max_tokens": 5, "temperature": 1.0, "top_p": 0.5, "top_k": 3, "seed": 1, "stop": ["x"]}
    assert spec == {"spec_method": "ngram", "num_draft_tokens": 4, "spec_threshold": 0.0}
    config = make_request_config('{"num_draft_tokens": "4", "spec_threshold": "0.5"}', True, None)
    assert (config.spec_method, config.num_draft_tokens, config.spec_threshold) == (None, 4, 0.5)
    assert parse_sampling_parameters(None) == ({}, {})
    assert parse_sampling_parameters("  ") == ({}, {})


def test_stop_token_ids_reach_the_sampling_parameters():
    sampling, _ = parse_sampling_parameters('{"stop_token_ids": [2, 7], "max_tokens": 3}')
    assert sampling == {"stop_token_ids": [2, 7], "max_tokens": 3}


@pytest.mark.parametrize("raw,message", [
    ("{", "not valid JSON"),
    ("3", "must be a JSON object"),
    ('{"n": 2, "best_of": 3}', "unknown sampling_parameters key(s): best_of, n"),
    ('{"max_tokens": 2.5}', "max_tokens must be an integer"),
    ('{"max_tokens": true}', "max_tokens must be an integer"),
    ('{"temperature": "hot"}', "temperature must be a number"),
    ('{"stop": [1]}', "stop must be a string or a list of strings"),
    ('{"stop_token_ids": [2, "3"]}', "stop_token_ids must be a list of integers"),
    ('{"stop_token_ids": 2}', "stop_token_ids must be a list of integers"),
    ('{"spec_method": 3}', "spec_method must be a string"),
    ('{"num_draft_tokens": 2.5}', "num_draft_tokens must be an integer"),
    ('{"spec_threshold": "high"}', "spec_threshold must be a number"),
    (b"\xff", "not valid UTF-8"),
])
def test_parse_sampling_parameters_rejects(raw, message):
    with pytest.raises(BadRequest, match=message.replace("(", r"\(").replace(")", r"\)")):
        parse_sampling_parameters(raw)


def test_request_config_follows_the_vllm_backend_defaults():
    assert make_request_config(None, None, None).include_prompt          # not streaming: prompt included
    assert not make_request_config(None, True, None).include_prompt      # streaming: new text only
    assert make_request_config(None, True, False).include_prompt         # unless asked for
    assert not make_request_config(None, False, True).include_prompt


# -- detokenization ------------------------------------------------------------------------------
def test_stable_holds_back_at_most_three_replacement_characters():
    assert stable("ab\ufffd") == "ab"
    assert stable("a\ufffd\ufffd\ufffd\ufffd") == "a\ufffd"
    assert stable("abc") == "abc"


def test_split_character_is_held_back_until_complete(decode, ckpt):
    from specserve.model.tokenizer import load_tokenizer
    tok = load_tokenizer(ckpt)
    ids = tok.encode("a龘").ids            # 龘 = E9 BE 98, not in the corpus: one token per byte
    assert len(ids) == 4
    pieces = [text_delta(decode, make_window(ids[:n], n - 1, flush=False)) for n in range(2, 5)]
    assert pieces == ["", "", "龘"]


def _byte_fallback_tokenizer():
    """Llama-2 / Mistral style: metaspace, byte-fallback tokens, a decoder that strips the first space."""
    from tokenizers import Tokenizer, decoders, models, normalizers, trainers

    from specserve.model.tiny import CORPUS
    tok = Tokenizer(models.BPE(byte_fallback=True, unk_token="<unk>"))
    tok.normalizer = normalizers.Sequence([normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")])
    tok.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(),
                                     decoders.Strip(" ", 1, 0)])
    special = ["<unk>", "<s>", "</s>"] + [f"<0x{b:02X}>" for b in range(256)]
    tok.train_from_iterator(CORPUS * 4, trainers.BpeTrainer(vocab_size=600, special_tokens=special,
                                                            show_progress=False))
    return tok


@pytest.mark.parametrize("style", ["byte-level", "byte-fallback"])
def test_streamed_pieces_concatenate_to_the_full_decode(ckpt, style):
    """Random token streams (mostly invalid UTF-8) cut into random chunks, windows included."""
    from specserve.model.tokenizer import load_tokenizer, make_decode
    tok = load_tokenizer(ckpt) if style == "byte-level" else _byte_fallback_tokenizer()
    decode = make_decode(tok)
    rng = random.Random(0)
    vocab = tok.get_vocab_size()
    for _ in range(1500):
        prompt = tok.encode(rng.choice(["hi ", "你好", "🚀 go", "x"])).ids
        tokens = prompt + [rng.randrange(vocab) for _ in range(rng.randrange(1, 40))]
        sent, pieces = len(prompt), []
        while sent < len(tokens):
            n = min(len(tokens), sent + rng.randrange(1, 5))
            piece = text_delta(decode, make_window(tokens[:n], sent, flush=n == len(tokens)))
            pieces.append(piece)
            sent = n
        assert "".join(pieces) == decode(tokens)[len(decode(prompt)):]


def test_window_reaches_back_a_few_tokens():
    w = make_window(list(range(20)), 15, flush=False)
    assert w.token_ids[w.read_offset:] == [15, 16, 17, 18, 19] and w.read_offset == 8
    assert make_window([1, 2, 3], 0, flush=True) == TokenWindow([1, 2, 3], 0, True)


# -- rendering -----------------------------------------------------------------------------------
def _parse(path: Path):
    from tritonclient.grpc import model_config_pb2
    return text_format.Parse(path.read_text(), model_config_pb2.ModelConfig())


def test_rendered_configs_carry_the_schema(ckpt, tmp_path):
    repo = render_repository(DeploymentSettings(ckpt, max_num_seqs=3, max_model_len=64, draft_policy="fixed"),
                             tmp_path / "repo")
    for spec in (*schema.ENSEMBLE_STEPS, schema.ENSEMBLE):
        cfg = _parse(repo / spec.name / "config.pbtxt")
        assert cfg.name == spec.name
        assert [(i.name, list(i.dims), i.optional) for i in cfg.input] == \
               [(t.name, list(t.dims), t.optional) for t in spec.inputs]
        assert [o.name for o in cfg.output] == [t.name for t in spec.outputs]
    verifier = _parse(repo / "target_verifier" / "config.pbtxt")
    assert verifier.model_transaction_policy.decoupled
    assert verifier.parameters["max_num_seqs"].string_value == "3"
    assert verifier.parameters["checkpoint"].string_value == str(Path(ckpt).resolve())
    ensemble = _parse(repo / "llm" / "config.pbtxt")
    steps = ensemble.ensemble_scheduling.step
    assert [s.model_name for s in steps] == ["preprocess", "target_verifier", "postprocess"]
    assert "cancel_request_id" not in steps[1].input_map  # sent only by postprocess over BLS
    for step in steps:
        assert (repo / step.model_name / "1" / "model.py").exists()


# -- launch helpers ------------------------------------------------------------------------------
def test_backend_dir_has_the_stub_beside_the_backend(tmp_path):
    from specserve.triton.launch import NGC_ROOT, prepare_backends, server_env
    backends = prepare_backends(tmp_path)
    if not (NGC_ROOT / "bin" / "tritonserver").exists():
        assert (backends / "python" / "triton_python_backend_stub").exists()
        assert (backends / "python" / "libtriton_python.so").exists()
    env = server_env({"PATH": "/usr/bin"})
    import sysconfig
    assert env["LD_LIBRARY_PATH"].split(":")[0] == sysconfig.get_config_var("LIBDIR")
    assert env["PATH"].split(":")[0] == str(Path(sys.executable).parent)


# -- the verifier service, with fake senders -------------------------------------------------------
class FakeSender:
    def __init__(self, delay: float = 0.0):
        self.responses, self.errors, self.closed, self.cancelled = [], [], False, False
        self.done = threading.Event()
        self.delay = delay  # a slow client: sends run on the engine thread, so generation slows too

    def send(self, r):
        time.sleep(self.delay)
        self.responses.append(r)
        if r.final:
            self.done.set()

    def send_error(self, message):
        self.errors.append(message)
        self.done.set()

    def close(self):
        self.closed = True
        self.done.set()

    def is_cancelled(self):
        return self.cancelled


@pytest.fixture(scope="module")
def service(ckpt):
    from specserve.serving.build import build_engine
    from specserve.serving.settings import DeploymentSettings
    from specserve.serving.verifier_service import VerifierService
    engine, _ = build_engine(DeploymentSettings(ckpt, max_num_seqs=4, max_model_len=256, draft_policy="fixed"))
    svc = VerifierService(engine)
    yield svc
    svc.stop()


def test_service_streams_windows_that_rebuild_the_text(service, decode):
    from specserve.serving.params import RequestConfig
    sender = FakeSender()
    prompt = [5, 6, 7]
    service.submit(prompt, RequestConfig(sampling={"max_tokens": 12}, stream=True), sender)
    assert sender.done.wait(30)
    assert sender.responses[-1].final and sender.responses[-1].meta.finish_reason in ("length", "stop")
    assert all(not r.final for r in sender.responses[:-1])
    text = "".join(text_delta(decode, r.window) for r in sender.responses)
    out = []
    for r in sender.responses:
        out += r.window.token_ids[r.window.read_offset:]
    assert text == decode(prompt + out)[len(decode(prompt)):]
    # Each response counts its own output tokens (the vLLM backend's num_output_tokens).
    assert [r.meta.num_output_tokens for r in sender.responses] == \
        [len(r.window.token_ids) - r.window.read_offset for r in sender.responses]
    assert sum(r.meta.num_output_tokens for r in sender.responses) == len(out)


def test_service_rejects_with_a_message_and_cancels(service):
    from specserve.core.engine import RequestRejected
    from specserve.serving.params import RequestConfig
    with pytest.raises(RequestRejected, match="unknown spec_method"):
        service.submit([1, 2], RequestConfig(spec_method="nope"), FakeSender())
    sender = FakeSender(delay=0.02)  # 240 tokens take ~5 s, far longer than the watcher's poll
    sender.cancelled = True  # the client is gone already: the watcher cancels in the engine
    service.submit([1, 2, 3], RequestConfig(sampling={"max_tokens": 240}, stream=True), sender)
    deadline = time.monotonic() + 10
    while service.num_live and time.monotonic() < deadline:
        time.sleep(0.05)
    assert service.num_live == 0 and service.engine.num_free_slots == 4
    # Triton still needs the final flag of a cancelled request: a bare one, sent once.
    assert sender.closed and len(sender.responses) < 240 and not sender.errors


def test_numbers_and_booleans_as_strings_are_accepted_like_the_vllm_backend():
    sampling, spec = parse_sampling_parameters(
        '{"max_tokens": "64", "temperature": "0.5", "top_k": " 3 ", "ignore_eos": "true", "spec_method": "ngram"}')
    assert sampling == {"max_tokens": 64, "temperature": 0.5, "top_k": 3, "ignore_eos": True}
    assert spec == {"spec_method": "ngram"}
    with pytest.raises(BadRequest, match='sampling_parameters.max_tokens must be an integer, got "6.5"'):
        parse_sampling_parameters('{"max_tokens": "6.5"}')
    with pytest.raises(BadRequest, match='sampling_parameters.ignore_eos must be a boolean, got "maybe"'):
        parse_sampling_parameters('{"ignore_eos": "maybe"}')


def test_build_engine_dtype(ckpt):
    import torch

    from specserve.serving.build import build_engine
    from specserve.serving.settings import DeploymentSettings
    engine, _ = build_engine(DeploymentSettings(ckpt, max_num_seqs=1, max_model_len=64, dtype="bfloat16",
                                                draft_policy="fixed"))
    assert engine.model.dtype == torch.bfloat16 and engine.cache.k.dtype == torch.bfloat16
    with pytest.raises(ValueError, match="dtype must be one of float32, bfloat16, got 'float16'"):
        build_engine(DeploymentSettings(ckpt, max_num_seqs=1, max_model_len=64, dtype="float16",
                                        draft_policy="fixed"))


def test_engine_is_built_and_run_on_the_loop_thread(ckpt):
    """A factory is called on the loop thread (the thread that then decodes); its error reaches
    the caller of start() instead of leaving a loop without an engine."""
    import threading

    from specserve.core.engine_loop import EngineLoop
    from specserve.serving.build import build_engine
    from specserve.serving.settings import DeploymentSettings

    seen = []

    def factory():
        seen.append(threading.current_thread().name)
        return build_engine(DeploymentSettings(ckpt, max_num_seqs=1, max_model_len=64, draft_policy="fixed"))[0]

    outs = []
    loop = EngineLoop(factory, outs.append).start()
    assert seen == ["specserve-engine"] and loop.engine is not None
    loop.submit(GenerationRequest("r", [1, 2, 3], SamplingParams(max_tokens=3)))
    deadline = time.monotonic() + 30
    while not any(o.finished for o in outs) and time.monotonic() < deadline:
        time.sleep(0.01)
    assert sum(len(o.new_token_ids) for o in outs) == 3
    loop.stop()

    def broken():
        raise CheckpointError("no such checkpoint")

    with pytest.raises(CheckpointError, match="no such checkpoint"):
        EngineLoop(broken, outs.append).start()


def test_drafter_dtype_resolution(ckpt):
    import torch

    from specserve.model.transformer import load_model
    from specserve.model.devices import resolve_drafter_dtype
    model = load_model(ckpt)
    want = torch.bfloat16 if torch.ops.mkldnn._is_mkldnn_bf16_supported() else torch.float32
    assert resolve_drafter_dtype("auto", model) == want
    assert resolve_drafter_dtype("float32", model) == torch.float32
    with pytest.raises(ValueError, match="drafter dtype must be auto or one of float32, bfloat16, got 'fp8'"):
        resolve_drafter_dtype("fp8", model)


def test_preprocess_accepts_the_vllm_backends_return_flags(ckpt):
    from specserve.serving.preprocess import Preprocessor

    pre = Preprocessor(ckpt, max_model_len=256, internal_key="k")
    counts = {"return_finish_reason": True, "return_num_input_tokens": True, "return_num_output_tokens": True}
    assert pre("hello", False, None, None, counts).input_ids == pre("hello", False, None, None).input_ids
    assert pre("hello", False, None, None, {"return_logprobs": False}).input_ids
    for flag in ("return_logprobs", "return_cumulative_logprob"):
        with pytest.raises(BadRequest, match=f"{flag}: specserve does not compute log-probabilities"):
            pre("hello", False, None, None, {flag: True})
