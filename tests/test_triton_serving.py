"""End to end through a real tritonserver: the rendered repository, gRPC streaming, HTTP generate,
errors, cancellation and metrics (issue 3).

Two servers start once for the module, in parallel: a tiny random Llama and a tiny random Qwen2,
each with a byte-level BPE tokenizer trained here. The Qwen2 checkpoint has no EOS, so a long
request there runs until it is cancelled.
"""

from __future__ import annotations

import json
import queue
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import torch

from conftest import make_tiny_checkpoint
from specserve.methods import registry
from specserve.triton.client import CompletionError, StreamClient, build_inputs
from specserve.triton.launch import TritonServer
from specserve.serving.settings import DeploymentSettings
from specserve.triton.render import render_repository
from specserve.model.tiny import train_tiny_tokenizer
from streams import scrape_metrics

pytestmark = pytest.mark.triton

MAX_MODEL_LEN = {"llama": 256, "qwen2": 2048}
PROMPTS = [
    "Hello 世界! 😀 the quick",
    "中文 and 龘 and 🚀",          # 龘 is not in the tokenizer's corpus: three byte tokens
    "def add(a, b):\n    return",
]

# Every method a deployment without drafters serves (those drafting with nothing).
PLAIN_METHODS = registry.with_drafts("nothing")


class Deployment:
    def __init__(self, family: str, root: Path):
        self.family = family
        self._hf = None
        self.ckpt = root / "ckpt"
        self.ckpt.mkdir(parents=True)
        train_tiny_tokenizer(self.ckpt)
        from tokenizers import Tokenizer
        self.tokenizer = Tokenizer.from_file(str(self.ckpt / "tokenizer.json"))
        extra = {"eos_token_id": None} if family == "qwen2" else {}
        make_tiny_checkpoint(self.ckpt, family, vocab_size=self.tokenizer.get_vocab_size(), seed=3,
                             max_position_embeddings=MAX_MODEL_LEN[family], **extra)
        repo = render_repository(DeploymentSettings(self.ckpt, max_num_seqs=16,
                                                    max_model_len=MAX_MODEL_LEN[family], draft_policy="fixed"),
                                 root / "model_repository")
        self.server = TritonServer(repo, root, None, log_file=root / "tritonserver.log",
                                   exit_timeout_s=5)

    def client(self) -> StreamClient:
        return StreamClient(self.server.grpc_url)

    def metrics(self) -> dict[str, float]:
        return scrape_metrics(self.server.metrics_url)

    def settled_metrics(self, timeout: float = 10.0) -> dict[str, float]:
        """Metrics once two scrapes 0.3 s apart agree (reports are queued in the server)."""
        prev, deadline = self.metrics(), time.monotonic() + timeout
        while time.monotonic() < deadline:
            time.sleep(0.3)
            now = self.metrics()
            if now == prev:
                return now
            prev = now
        raise AssertionError("metrics kept changing")

    def hf_greedy(self, prompt: str, max_tokens: int) -> tuple[str, int]:
        import transformers
        if self._hf is None:
            self._hf = transformers.AutoModelForCausalLM.from_pretrained(self.ckpt, dtype=torch.float32).eval()
        model = self._hf
        ids = torch.tensor([self.tokenizer.encode(prompt).ids])
        with torch.no_grad():
            out = model.generate(ids, max_new_tokens=max_tokens, do_sample=False, pad_token_id=0)
        new = out[0, ids.shape[1]:].tolist()
        return self.tokenizer.decode(new, skip_special_tokens=True), len(new)


@pytest.fixture(scope="module")
def deployments(tmp_path_factory):
    deps = {f: Deployment(f, tmp_path_factory.mktemp(f"triton_{f}")) for f in ("llama", "qwen2")}
    try:
        for d in deps.values():
            d.server.start()
        for d in deps.values():
            d.server.wait_ready(600)
        yield deps
    finally:
        with ThreadPoolExecutor(len(deps)) as pool:  # shutdown unloads models: stop both at once
            list(pool.map(lambda d: d.server.stop(), deps.values()))


@pytest.fixture(scope="module")
def llama(deployments):
    return deployments["llama"]


def test_a_prompt_splits_a_character_across_tokens(llama):
    # The point of the 龘 prompt: its tokens are pieces of one character.
    ids = llama.tokenizer.encode(PROMPTS[1]).ids
    assert any("\ufffd" in llama.tokenizer.decode([i]) for i in ids)


@pytest.mark.parametrize("family", ["llama", "qwen2"])
@pytest.mark.parametrize("method", PLAIN_METHODS)
def test_greedy_stream_equals_transformers(deployments, family, method):
    dep = deployments[family]
    client = dep.client()
    for prompt in PROMPTS:
        want, n = dep.hf_greedy(prompt, 24)
        got = client.generate(prompt, {"max_tokens": 24, "spec_method": method})
        assert got.text == want, (prompt, got.chunks)
        assert got.num_output_tokens == n
        assert got.num_input_tokens == len(dep.tokenizer.encode(prompt).ids)
        assert got.finish_reason in ("length", "stop")
        assert got.spec_stats["method"] == method
        assert len(got.chunks) > 1  # streamed, not one blob
        # Never half a character: a held-back partial character shows as U+FFFD at a chunk end
        # only if the model itself produced invalid UTF-8, which then stays U+FFFD in `want`.
        assert all(not c.endswith("\ufffd") or "\ufffd" in want for c in got.chunks)


def test_stream_false_returns_one_response_with_the_prompt(llama):
    got = llama.client().generate(PROMPTS[0], {"max_tokens": 8}, stream=False)
    want, _ = llama.hf_greedy(PROMPTS[0], 8)
    assert len(got.chunks) == 1
    assert got.text == PROMPTS[0] + want  # vLLM backend default: prompt included when not streaming
    excluded = llama.client().generate(PROMPTS[0], {"max_tokens": 8}, stream=False, exclude_input_in_output=True)
    assert excluded.text == want
    streamed = llama.client().generate(PROMPTS[0], {"max_tokens": 8}, stream=True, exclude_input_in_output=False)
    assert streamed.chunks[0].startswith(PROMPTS[0]) and streamed.text == PROMPTS[0] + want


@pytest.mark.parametrize("method", PLAIN_METHODS)
def test_seeded_sampling_is_reproducible(llama, method):
    params = {"max_tokens": 16, "temperature": 0.9, "top_p": 0.9, "top_k": 50, "seed": 7, "spec_method": method}
    a = llama.client().generate(PROMPTS[2], params)
    b = llama.client().generate(PROMPTS[2], params)
    assert a.text == b.text and a.num_output_tokens == b.num_output_tokens


def test_16_concurrent_streams_each_equal_their_solo_output(llama):
    jobs = [(f"{PROMPTS[i % 3]} #{i}", {"max_tokens": 20, "spec_method": ("none", "ngram")[i % 2]})
            for i in range(16)]
    solo = [llama.client().generate(p, s).text for p, s in jobs]
    barrier = threading.Barrier(16)

    def run(job):
        client = llama.client()
        barrier.wait()
        return client.generate(*job).text

    with ThreadPoolExecutor(16) as pool:
        together = list(pool.map(run, jobs))
    assert together == solo


# (case, text_input, sampling_parameters, the error's message). Every case runs over gRPC
# streaming and over HTTP generate; docs/reliability/README.md's table of bad inputs is this list.
HUGE = "x" * 2_200_000  # refused by size before it is tokenized
BAD_INPUTS = [
    ("missing text_input", None, {"max_tokens": 4}, "missing required input 'text_input'"),
    ("empty prompt", "", {"max_tokens": 4}, "text_input is empty"),
    ("prompt longer than the model", "hello world " * 200, {"max_tokens": 4},
     "prompt (2200 tokens) plus max_tokens (4) exceeds the model length 256"),
    ("prompt of 2.2 MB", HUGE, {"max_tokens": 4}, "text_input is 2200000 bytes, more than any prompt that fits "
     "the model length 256 can have"),
    ("max_tokens 0", "hi", {"max_tokens": 0}, "max_tokens must be a positive integer, got 0"),
    ("max_tokens negative", "hi", {"max_tokens": -5}, "max_tokens must be a positive integer, got -5"),
    ("max_tokens above the limit", "hi", {"max_tokens": 100000}, "max_tokens=100000 exceeds the limit 256"),
    ("max_tokens not an integer", "hi", {"max_tokens": "ten"},
     'sampling_parameters.max_tokens must be an integer, got "ten"'),
    ("max_tokens a float", "hi", {"max_tokens": 4.5}, "sampling_parameters.max_tokens must be an integer, got 4.5"),
    ("not JSON", "hi", '{"max_tokens": 4', "sampling_parameters is not valid JSON"),
    ("JSON but not an object", "hi", "[4]", "sampling_parameters must be a JSON object, got list"),
    ("unknown keys", "hi", {"max_tokens": 4, "beam_width": 2, "foo": 1},
     "unknown sampling_parameters key(s): beam_width, foo"),
    ("negative temperature", "hi", {"temperature": -0.5}, "temperature must be a finite number >= 0, got -0.5"),
    ("NaN temperature", "hi", '{"temperature": NaN}', "temperature must be a finite number >= 0, got nan"),
    ("infinite temperature", "hi", '{"temperature": Infinity}', "temperature must be a finite number >= 0, got inf"),
    ("denormal temperature", "hi", {"temperature": 1e-45},
     "temperature must be 0 (greedy) or at least 1e-05, got 1e-45"),
    ("temperature a string", "hi", {"temperature": "hot"},
     'sampling_parameters.temperature must be a number, got "hot"'),
    ("top_p zero", "hi", {"top_p": 0}, "top_p must be in (0, 1], got 0.0"),
    ("top_p above one", "hi", {"top_p": 1.5}, "top_p must be in (0, 1], got 1.5"),
    ("top_p NaN", "hi", '{"top_p": NaN}', "top_p must be in (0, 1], got nan"),
    ("negative top_k", "hi", {"top_k": -1}, "top_k must be an integer >= 0, got -1"),
    ("seed beyond 64 bits", "hi", {"seed": 2 ** 70},
     "seed must be an integer in [0, 2^64), got 1180591620717411303424"),
    ("stop not strings", "hi", {"stop": [1, 2]}, "sampling_parameters.stop must be a string or a list of strings, got [1, 2]"),
    ("ignore_eos not a boolean", "hi", {"ignore_eos": "maybe"},
     'sampling_parameters.ignore_eos must be a boolean, got "maybe"'),
    ("unknown spec_method", "hi", {"spec_method": "eagle9"}, "unknown spec_method 'eagle9'; available: ngram, none"),
    ("num_draft_tokens out of range", "hi", {"num_draft_tokens": 99},
     "num_draft_tokens must be an integer in [0, 8] (the server's max_draft_len), got 99"),
    ("spec_threshold out of range", "hi", {"spec_threshold": 2},
     "spec_threshold must be a number in [0, 1], got 2.0"),
    ("unknown draft_policy", "hi", {"draft_policy": "greedy"},
     "draft_policy must be one of adaptive, fixed, got 'greedy'"),
    ("invalid UTF-8", b"abc\xff\xfe def", {"max_tokens": 4}, "text_input is not valid UTF-8: invalid start byte at byte 3"),
]
GOOD = ("hi there", {"max_tokens": 6})


@pytest.fixture(scope="module")
def good_output(llama):
    return llama.client().generate(*GOOD).text


def _http_generate(dep, prompt, params) -> tuple[int, str]:
    body = {} if prompt is None else {"text_input": prompt}
    body["sampling_parameters"] = params if isinstance(params, str) else json.dumps(params)
    try:
        with urllib.request.urlopen(_post(f"http://{dep.server.http_url}/v2/models/llm/generate", body),
                                    timeout=60) as r:
            return r.status, r.read().decode()
    except urllib.error.HTTPError as e:
        return e.code, e.read().decode()


@pytest.mark.parametrize("name,prompt,params,message", BAD_INPUTS, ids=[b[0] for b in BAD_INPUTS])
def test_bad_input_gets_its_error_over_grpc_and_the_next_request_is_unchanged(llama, good_output, name, prompt,
                                                                              params, message):
    client = llama.client()
    with pytest.raises(CompletionError) as err:
        client.generate(prompt, params, timeout=30)
    assert str(err.value).startswith(f"in ensemble 'llm', {message}"), str(err.value)
    assert client.generate(*GOOD).text == good_output


@pytest.mark.parametrize("name,prompt,params,message",
                         [b for b in BAD_INPUTS if isinstance(b[1], (str, type(None)))],
                         ids=[b[0] for b in BAD_INPUTS if isinstance(b[1], (str, type(None)))])
def test_bad_input_gets_its_error_over_http_and_the_next_request_is_unchanged(llama, good_output, name, prompt,
                                                                              params, message):
    status, body = _http_generate(llama, prompt, params)
    assert status == 400 and message in json.loads(body)["error"], (status, body)
    status, body = _http_generate(llama, *GOOD)
    assert status == 200 and json.loads(body)["text_output"] == GOOD[0] + good_output


def _raw_grpc_error(dep, inputs, *, stream: bool = True) -> str:
    import tritonclient.grpc as grpcclient
    from tritonclient.utils import InferenceServerException
    client = grpcclient.InferenceServerClient(dep.server.grpc_url)
    if not stream:
        with pytest.raises(InferenceServerException) as err:
            client.infer("llm", inputs, timeout=30)
        return err.value.message()
    results: queue.Queue = queue.Queue()
    client.start_stream(callback=lambda result, error: results.put((result, error)))
    try:
        client.async_stream_infer("llm", inputs)
        result, error = results.get(timeout=30)
    finally:
        client.stop_stream()
    assert error is not None, "no error"
    return error.message() if hasattr(error, "message") else str(error)


def _tensor(name, arr, dtype):
    import tritonclient.grpc as grpcclient
    t = grpcclient.InferInput(name, list(arr.shape), dtype)
    t.set_data_from_numpy(arr)
    return t


def test_malformed_tensors_get_clear_errors(llama, good_output):
    import numpy as np
    two = _tensor("text_input", np.array([b"a", b"b"], dtype=object), "BYTES")
    assert "unexpected shape for input 'text_input' for model 'llm'. Expected [1], got [2]" in \
        _raw_grpc_error(llama, [two])
    wrong_type = _tensor("text_input", np.array([7], dtype=np.int64), "INT64")
    assert "inference input 'text_input' data-type is 'INT64', but model 'llm' expects 'BYTES'" in \
        _raw_grpc_error(llama, [wrong_type])
    # The ensemble is decoupled (streaming): a unary call is refused by Triton itself.
    text = _tensor("text_input", np.array([b"hi"], dtype=object), "BYTES")
    assert "doesn't support models with decoupled transaction policy" in _raw_grpc_error(llama, [text], stream=False)
    status, body = 0, ""
    try:
        urllib.request.urlopen(urllib.request.Request(f"http://{llama.server.http_url}/v2/models/llm/generate",
                                                      data=b'{"text_input": "hi", ', method="POST"), timeout=30)
    except urllib.error.HTTPError as e:
        status, body = e.code, e.read().decode()
    # Triton's own HTTP front end answers a malformed body with 500 (not ours to change).
    assert (status, json.loads(body)["error"]) == (
        500, "failed to parse the request JSON buffer: Missing a name for object member. at 21"), (status, body)
    assert llama.client().generate(*GOOD).text == good_output


def test_client_cancel_mid_stream_frees_the_slot(deployments):
    dep = deployments["qwen2"]  # no EOS: 1900 tokens take far longer than the cancel
    before = dep.metrics()
    client = dep.client().client
    results: queue.Queue = queue.Queue()
    client.start_stream(callback=lambda result, error: results.put((result, error)))
    client.async_stream_infer("llm", build_inputs("cancel me", {"max_tokens": 1900}),
                              enable_empty_final_response=True)
    for _ in range(3):
        result, error = results.get(timeout=60)
        assert error is None
    client.stop_stream(cancel_requests=True)

    key = 'specserve_request_success_total{finished_reason="abort",method="none",tier="default"}'
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline:
        now = dep.metrics()
        if now.get(key, 0) > before.get(key, 0) and now.get("specserve_num_requests_running") == 0:
            break
        time.sleep(0.2)
    else:
        pytest.fail(f"no abort recorded after the cancel: {now}")
    # It stopped early, and the server serves the next request.
    gen = 'specserve_generation_tokens_total{method="none",tier="default"}'
    assert now[gen] - before.get(gen, 0) < 1900
    assert dep.client().generate("next", {"max_tokens": 4}).num_output_tokens == 4


DISCONNECTING_CLIENT = """
import os, queue, sys
import tritonclient.grpc as grpcclient
from specserve.triton.client import build_inputs
client = grpcclient.InferenceServerClient(sys.argv[1])
results = queue.Queue()
client.start_stream(callback=lambda result, error: results.put((result, error)))
client.async_stream_infer("llm", build_inputs("disconnect me", {"max_tokens": 1900}))
results.get(timeout=60)
print("got a response", flush=True)
os._exit(0)  # vanish mid-stream: no cancel, no stream close
"""


def wait_until_aborted(dep, key: str, before: dict, message: str, timeout: float = 20.0) -> None:
    """Until the abort counter `key` has risen past `before` and no request runs (or fail)."""
    deadline = time.monotonic() + timeout
    while not (dep.metrics().get(key, 0) > before.get(key, 0)
               and dep.metrics().get("specserve_num_requests_running") == 0):
        assert time.monotonic() < deadline, message
        time.sleep(0.2)


def test_client_that_disconnects_mid_stream_frees_the_slot(deployments):
    dep = deployments["qwen2"]
    key = 'specserve_request_success_total{finished_reason="abort",method="none",tier="default"}'
    before = dep.metrics()
    done = subprocess.run([sys.executable, "-c", DISCONNECTING_CLIENT, dep.server.grpc_url],
                          capture_output=True, text=True, timeout=120)
    assert "got a response" in done.stdout, done.stderr
    wait_until_aborted(dep, key, before, "the disconnected client's request still runs")


def test_http_stream_client_that_disconnects_frees_the_slot(deployments):
    dep = deployments["qwen2"]
    key = 'specserve_request_success_total{finished_reason="abort",method="none",tier="default"}'
    before = dep.metrics()
    body = json.dumps({"text_input": "hi", "stream": True,
                       "sampling_parameters": json.dumps({"max_tokens": 1900})}).encode()
    with socket.create_connection(("localhost", dep.server.ports.http), timeout=60) as conn:
        conn.sendall(b"POST /v2/models/llm/generate_stream HTTP/1.1\r\nHost: localhost\r\n"
                     b"Content-Type: application/json\r\nContent-Length: %d\r\n\r\n" % len(body) + body)
        received = b""
        while b"data:" not in received:  # wait for the first event, then hang up
            chunk = conn.recv(4096)
            assert chunk, "the server closed the stream before any event"
            received += chunk
    wait_until_aborted(dep, key, before, "the disconnected HTTP client's request still runs")


def _preprocess(dep, prompt: str, sampling: dict) -> dict:
    """Call preprocess directly, as any client can: its outputs are signed for this request only."""
    import numpy as np
    import tritonclient.grpc as grpcclient

    from specserve.serving import schema
    client = grpcclient.InferenceServerClient(dep.server.grpc_url)
    inputs = [_tensor(schema.TEXT_INPUT.name, np.array([prompt.encode()], dtype=object), "BYTES"),
              _tensor(schema.SAMPLING_PARAMETERS.name, np.array([json.dumps(sampling).encode()], dtype=object), "BYTES"),
              _tensor(schema.STREAM.name, np.array([True]), "BOOL")]
    out = client.infer(schema.PREPROCESS.name, inputs)
    return {t.name: out.as_numpy(t.name) for t in schema.PREPROCESS.outputs}


def _verifier_stream(dep, tensors: dict):
    """Start a direct target_verifier stream with the given {name: array} inputs."""
    import tritonclient.grpc as grpcclient
    dtypes = {"INT64": "INT64", "STRING": "BYTES"}
    from specserve.serving import schema
    specs = {t.name: t for t in schema.TARGET_VERIFIER.inputs}
    client = grpcclient.InferenceServerClient(dep.server.grpc_url)
    results: queue.Queue = queue.Queue()
    client.start_stream(callback=lambda result, error: results.put((result, error)))
    client.async_stream_infer(schema.TARGET_VERIFIER.name,
                              [_tensor(k, v, dtypes[specs[k].dtype]) for k, v in tensors.items()])
    return client, results


def test_direct_calls_to_target_verifier_get_no_more_than_the_ensemble_allows(deployments):
    """A client that calls target_verifier itself: unsigned requests are refused; a request that
    preprocess signed runs exactly like the ensemble's and is cancelled by the watcher when the
    client goes; and no request id lets it cancel another client's stream."""
    import numpy as np

    from specserve.serving import schema
    from specserve.serving.params import RequestConfig
    dep = deployments["qwen2"]

    # 1. Unsigned (hand-made ids and config): refused.
    client, results = _verifier_stream(dep, {
        schema.INPUT_IDS.name: np.array([5, 6, 7], dtype=np.int64),
        schema.REQUEST_CONFIG.name: np.array([RequestConfig(sampling={"max_tokens": 1900}).to_json().encode()],
                                             dtype=object)})
    result, error = results.get(timeout=30)
    assert error is not None and error.message() == (
        "target_verifier is internal: call the 'llm' ensemble (this request was not prepared by preprocess)")
    client.stop_stream()
    client, results = _verifier_stream(dep, {})
    assert results.get(timeout=30)[1].message() == "target_verifier is internal: call the 'llm' ensemble"
    client.stop_stream()

    # 2. Signed by preprocess: it runs; its response_meta shows the attacker its own request id.
    before = dep.metrics()
    attacker, att_results = _verifier_stream(dep, _preprocess(dep, "mine", {"max_tokens": 1900}))
    result, error = att_results.get(timeout=60)
    assert error is None
    own_id = json.loads(result.as_numpy(schema.RESPONSE_META.name).reshape(-1)[0])["request_id"]
    prefix, n = own_id.rsplit("-", 1)

    # 3. A victim streams through the ensemble; its id is the next one. Cancel attempts with
    # the guessed id (and a wrong key) are refused, and the victim's output is exactly its solo one.
    want = dep.client().generate("victim", {"max_tokens": 300})
    victim_id = f"{prefix}-{int(n) + 2}"   # the solo run above took id n + 1
    victim: queue.Queue = queue.Queue()
    threading.Thread(target=lambda: victim.put(dep.client().generate("victim", {"max_tokens": 300})),
                     daemon=True).start()
    for key in (None, "guess"):
        tensors = {schema.CANCEL_REQUEST_ID.name: np.array([victim_id.encode()], dtype=object)}
        if key:
            tensors[schema.INTERNAL_KEY.name] = np.array([key.encode()], dtype=object)
        c, r = _verifier_stream(dep, tensors)
        assert r.get(timeout=30)[1].message() == "cancel_request_id is reserved for the server itself"
        c.stop_stream()
        c, r = _verifier_stream(dep, {schema.CONTROL.name: np.array([b"abort"], dtype=object)})
        assert r.get(timeout=30)[1].message() == "control is reserved for the server itself"
        c.stop_stream()
    got = victim.get(timeout=120)
    assert (got.text, got.num_output_tokens, got.finish_reason) == (want.text, want.num_output_tokens,
                                                                    want.finish_reason)

    # 4. The attacker's own request is cancelled by the watcher when its client goes.
    attacker.stop_stream(cancel_requests=True)
    key = 'specserve_request_success_total{finished_reason="abort",method="none",tier="default"}'
    wait_until_aborted(dep, key, before, "the direct request was not cancelled")


def test_metrics_counters_move(llama):
    before = llama.settled_metrics()  # earlier tests' reports may still be in flight
    # A repetitive prompt gives n-gram lookup something to draft.
    got = llama.client().generate("a b c a b c a b c a b c a b", {"max_tokens": 32, "spec_method": "ngram"})
    labels = '{method="ngram",tier="default"}'
    # Metrics are reported from a worker thread, in order; the TPOT histogram comes last.
    last = "specserve_time_per_output_token_seconds_count" + labels
    deadline = time.monotonic() + 10
    while (after := llama.metrics()).get(last, 0) <= before.get(last, 0):
        assert time.monotonic() < deadline, "metrics did not move"
        time.sleep(0.2)

    def moved(name):
        return after.get(name + labels, 0) - before.get(name + labels, 0)

    assert got.spec_stats["draft_tokens"] > 0
    assert moved("specserve_spec_decode_num_drafts_total") == got.spec_stats["drafts"]
    assert moved("specserve_spec_decode_num_draft_tokens_total") == got.spec_stats["draft_tokens"]
    assert moved("specserve_spec_decode_num_accepted_tokens_total") == got.spec_stats["accepted_tokens"]
    assert moved("specserve_generation_tokens_total") == got.num_output_tokens
    assert moved("specserve_time_to_first_token_seconds_count") == 1
    assert moved("specserve_time_per_output_token_seconds_count") == 1
    per_pos = sum(v for k, v in after.items()
                  if k.startswith("specserve_spec_decode_num_accepted_tokens_per_pos_total") and 'method="ngram"' in k)
    per_pos_before = sum(v for k, v in before.items()
                         if k.startswith("specserve_spec_decode_num_accepted_tokens_per_pos_total") and 'method="ngram"' in k)
    assert per_pos - per_pos_before == got.spec_stats["accepted_tokens"]


def _post(url: str, body: dict) -> urllib.request.Request:
    return urllib.request.Request(url, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"})


def test_http_generate_stream_sse(llama):
    prompt = PROMPTS[1]
    params = {"max_tokens": 16, "spec_method": "ngram"}
    want = llama.client().generate(prompt, params)
    body = {"text_input": prompt, "stream": True, "exclude_input_in_output": True,
            "sampling_parameters": json.dumps(params)}
    events = []
    with urllib.request.urlopen(_post(f"http://{llama.server.http_url}/v2/models/llm/generate_stream", body),
                                timeout=60) as r:
        for line in r:  # curl-style: one "data: {json}" line per event, blank lines between
            line = line.decode().strip()
            if line.startswith("data:"):
                events.append(json.loads(line[len("data:"):]))
    assert len(events) > 1
    assert "".join(e["text_output"] for e in events) == want.text
    assert events[-1]["finish_reason"] == want.finish_reason
    assert json.loads(events[-1]["spec_stats"])["method"] == "ngram"

    one = json.loads(urllib.request.urlopen(
        _post(f"http://{llama.server.http_url}/v2/models/llm/generate",
              {"text_input": prompt, "sampling_parameters": json.dumps(params)}), timeout=60).read())
    assert one["text_output"] == prompt + want.text

    with pytest.raises(urllib.error.HTTPError) as err:
        urllib.request.urlopen(_post(f"http://{llama.server.http_url}/v2/models/llm/generate",
                                     {"text_input": prompt, "sampling_parameters": '{"top_k": -2}'}), timeout=60)
    assert "top_k must be an integer >= 0" in err.value.read().decode()
