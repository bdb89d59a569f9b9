"""The OpenAI-compatible API (specserve/openai/) with the official `openai` client, streaming and
not, against a real tritonserver on a tiny checkpoint that has a chat template. The expected text
is what the same prompt gives over gRPC directly (greedy), so the API adds nothing and loses nothing."""

from __future__ import annotations

import http.client
import json
import time
import urllib.request

import openai
import pytest

from conftest import make_served_checkpoint, running_server, serve_process
from streams import scrape_metrics
from specserve.openai.chat import ChatTemplate
from specserve.openai.server import make_server
from specserve.triton.client import CompletionError, StreamClient, build_inputs
from specserve.serving.settings import DeploymentSettings
from specserve.triton.render import render_repository

pytestmark = pytest.mark.triton

TEMPLATE = ("{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
            "{% if add_generation_prompt %}assistant:{% endif %}")
MESSAGES = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "def add(a, b):"}]


@pytest.fixture(scope="module")
def deployment(tmp_path_factory):
    root = tmp_path_factory.mktemp("openai")
    ckpt = make_served_checkpoint(root / "tiny-chat", seed=3)
    (ckpt / "tokenizer_config.json").write_text(json.dumps(
        {"chat_template": TEMPLATE, "bos_token": "<s>", "eos_token": "</s>", "unk_token": "<unk>"}))
    repo = render_repository(DeploymentSettings(ckpt, max_num_seqs=2, max_model_len=256, draft_policy="fixed"), root / "model_repository")
    with running_server(repo, root) as srv:
        api = make_server(srv.grpc_url, 0, ckpt, 256).start()
        grpc = StreamClient(srv.grpc_url)
        try:
            yield srv, api, grpc, ChatTemplate(ckpt), ckpt
        finally:
            grpc.close()
            api.stop()


@pytest.fixture(scope="module")
def client(deployment):
    api = deployment[1]
    return openai.OpenAI(base_url=f"http://127.0.0.1:{api.port}/v1", api_key="unused", max_retries=0)


def direct(deployment, prompt: str, sampling: dict):
    return deployment[2].generate(prompt, sampling)


def test_models_lists_the_checkpoint_folder(client):
    models = client.models.list().data
    assert [m.id for m in models] == ["tiny-chat"]


def test_chat_completion_equals_direct_grpc(client, deployment):
    want = direct(deployment, deployment[3].render(MESSAGES), {"max_tokens": 8, "temperature": 0})
    got = client.chat.completions.create(model="tiny-chat", messages=MESSAGES, max_tokens=8, temperature=0)
    choice = got.choices[0]
    assert choice.message.role == "assistant" and choice.message.content == want.text
    assert choice.finish_reason == want.finish_reason
    assert (got.usage.prompt_tokens, got.usage.completion_tokens) == (want.num_input_tokens, want.num_output_tokens)
    assert got.usage.total_tokens == want.num_input_tokens + want.num_output_tokens
    assert got.model_extra["spec_stats"]["method"] == "none"
    # max_completion_tokens is the newer name of max_tokens.
    again = client.chat.completions.create(model="tiny-chat", messages=MESSAGES, max_completion_tokens=8,
                                           temperature=0)
    assert again.choices[0].message.content == want.text


@pytest.mark.parametrize("include_usage", [True, False])
def test_chat_stream_equals_direct_grpc(client, deployment, include_usage):
    want = direct(deployment, deployment[3].render(MESSAGES), {"max_tokens": 10, "temperature": 0,
                                                              "spec_method": "ngram"})
    kw = {"stream_options": {"include_usage": True}} if include_usage else {}
    chunks = list(client.chat.completions.create(model="tiny-chat", messages=MESSAGES, max_tokens=10, temperature=0,
                                                 stream=True, extra_body={"spec_method": "ngram"}, **kw))
    with_choices = [c for c in chunks if c.choices]
    assert with_choices[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in with_choices) == want.text
    assert [c.choices[0].finish_reason for c in with_choices][-1] == want.finish_reason
    assert all(c.choices[0].finish_reason is None for c in with_choices[:-1])
    assert with_choices[-1].model_extra["spec_stats"]["method"] == "ngram"
    if include_usage:
        assert not chunks[-1].choices and chunks[-1].usage.completion_tokens == want.num_output_tokens
        assert chunks[-1].usage.prompt_tokens == want.num_input_tokens
        assert all(c.usage is None for c in chunks[:-1])
    else:
        assert all(c.usage is None for c in chunks)


def test_completions_stream_and_not(client, deployment):
    prompt = "Hello 世界! 😀 the quick"
    want = direct(deployment, prompt, {"max_tokens": 12, "temperature": 0, "stop": ["qu"], "ignore_eos": True})
    got = client.completions.create(model="tiny-chat", prompt=prompt, max_tokens=12, temperature=0, stop=["qu"],
                                    extra_body={"ignore_eos": True})
    assert got.choices[0].text == want.text and got.choices[0].finish_reason == want.finish_reason
    assert got.usage.completion_tokens == want.num_output_tokens
    streamed = list(client.completions.create(model="tiny-chat", prompt=prompt, max_tokens=12, temperature=0,
                                              stop=["qu"], stream=True, extra_body={"ignore_eos": True}))
    assert "".join(c.choices[0].text for c in streamed) == want.text
    # A seed makes sampling reproducible (temperature 1 is OpenAI's default).
    a, b = (client.completions.create(model="tiny-chat", prompt=prompt, max_tokens=8, seed=7, top_p=0.9)
            for _ in range(2))
    assert a.choices[0].text == b.choices[0].text


@pytest.mark.parametrize("kwargs,param", [
    ({"n": 2}, "n"),
    ({"max_tokens": 0}, "max_tokens"),
    ({"temperature": "hot"}, "temperature"),
    ({"top_p": 1.5}, "top_p"),
    ({"presence_penalty": 0.5}, "presence_penalty"),
    ({"extra_body": {"spec_method": 3}}, "spec_method"),
    ({"extra_body": {"top_k": -1}}, "top_k"),            # checked by the server, field still named
    ({"max_tokens": 100000}, "max_tokens"),
])
def test_bad_requests_get_the_openai_error_shape(client, kwargs, param):
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model="tiny-chat", messages=MESSAGES, **kwargs)
    assert e.value.status_code == 400
    assert e.value.body["param"] == param and e.value.body["type"] == "invalid_request_error"


def test_unknown_model_is_404(client):
    with pytest.raises(openai.NotFoundError) as e:
        client.chat.completions.create(model="gpt-4", messages=MESSAGES, max_tokens=2)
    assert e.value.body["code"] == "model_not_found" and e.value.body["param"] == "model"


def test_disconnect_mid_stream_cancels_the_engine_request(deployment):
    srv, api = deployment[:2]
    key = 'specserve_request_success_total{finished_reason="abort",method="none",tier="default"}'
    before = scrape_metrics(srv.metrics_url)
    body = {"model": "tiny-chat", "prompt": "cancel me", "max_tokens": 240, "temperature": 0, "stream": True,
            "ignore_eos": True}
    conn = http.client.HTTPConnection("127.0.0.1", api.port, timeout=60)
    conn.request("POST", "/v1/completions", json.dumps(body), {"Content-Type": "application/json"})
    response = conn.getresponse()
    assert response.status == 200 and response.readline().startswith(b"data: ")  # streaming; now hang up
    response.close()
    conn.close()
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        now = scrape_metrics(srv.metrics_url)
        if now.get(key, 0) > before.get(key, 0) and now.get("specserve_num_requests_running") == 0:
            break
        time.sleep(0.2)
    else:
        pytest.fail(f"no abort recorded after the client hung up: {now}")
    gen = 'specserve_generation_tokens_total{method="none",tier="default"}'
    assert now[gen] - before.get(gen, 0) < 240


def test_vllm_backend_return_flags_over_grpc(deployment):
    """The inputs Triton's OpenAI frontend sends the vLLM backend; num_output_tokens per response."""
    grpc = deployment[2]
    flags = {"return_finish_reason": True, "return_num_input_tokens": True, "return_num_output_tokens": True}
    results = []
    grpc.client.start_stream(callback=lambda result, error: results.append((result, error)))
    try:
        grpc.client.async_stream_infer("llm", build_inputs("def add(a, b):", {"max_tokens": 6, "ignore_eos": True},
                                                           return_flags=flags), enable_empty_final_response=True)
        deadline = time.monotonic() + 120
        while not (results and results[-1][0] is not None
                   and results[-1][0].get_response().parameters["triton_final_response"].bool_param):
            assert time.monotonic() < deadline and all(e is None for _, e in results)
            time.sleep(0.05)
    finally:
        grpc.client.stop_stream()
    counts = [int(r.as_numpy("num_output_tokens")[0]) for r, _ in results if r.as_numpy("text_output") is not None]
    assert sum(counts) == 6 and all(c >= 1 for c in counts)
    with pytest.raises(CompletionError, match="return_logprobs: specserve does not compute log-probabilities"):
        _with_flag(grpc, "return_logprobs")


def _with_flag(grpc, flag):
    import queue

    results: queue.Queue = queue.Queue()
    grpc.client.start_stream(callback=lambda result, error: results.put((result, error)))
    try:
        grpc.client.async_stream_infer("llm", build_inputs("x", {"max_tokens": 2}, return_flags={flag: True}))
        _, error = results.get(timeout=120)
        if error is not None:
            raise CompletionError(error.message())
    finally:
        grpc.client.stop_stream()


def test_http_error_body_for_invalid_json(deployment):
    api = deployment[1]
    req = urllib.request.Request(f"http://127.0.0.1:{api.port}/v1/chat/completions", data=b"{nope",
                                 headers={"Content-Type": "application/json"})
    with pytest.raises(urllib.error.HTTPError) as e:
        urllib.request.urlopen(req, timeout=30)
    assert e.value.code == 400 and "error" in json.loads(e.value.read())


def _port_from(proc, timeout: float = 300) -> int:
    """The port in `specserve openai`'s banner (it bound port 0)."""
    import re

    lines, deadline = [], time.monotonic() + timeout
    for line in proc.stdout:
        lines.append(line)
        if "OpenAI API for" in line:
            return int(re.search(r":(\d+)/v1", line).group(1))
        if time.monotonic() > deadline:
            break
    pytest.fail("".join(lines[-20:]))


def _chat_once(port: int) -> str:
    client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="unused", max_retries=0)
    assert [m.id for m in client.models.list().data] == ["tiny-chat"]
    return client.chat.completions.create(model="tiny-chat", messages=MESSAGES, max_tokens=4,
                                          temperature=0).choices[0].message.content


def test_specserve_openai_alone_against_a_running_server(deployment):
    import subprocess
    import sys

    srv, chat, ckpt = deployment[0], deployment[3], deployment[4]
    proc = subprocess.Popen([sys.executable, "-m", "specserve.cli.main", "openai", "--url", srv.grpc_url,
                             "--port", "0", "--target", str(ckpt), "--max-model-len", "256"],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        port = _port_from(proc)
        want = direct(deployment, chat.render(MESSAGES), {"max_tokens": 4, "temperature": 0}).text
        assert _chat_once(port) == want
    finally:
        proc.terminate()
        proc.wait(30)


def test_serve_with_openai_port(tmp_path):
    import sys

    ckpt = make_served_checkpoint(tmp_path / "tiny-chat", seed=3)
    (ckpt / "tokenizer_config.json").write_text(json.dumps({"chat_template": TEMPLATE, "eos_token": "</s>"}))
    with serve_process([sys.executable, "-m", "specserve.cli.main"], "--target", str(ckpt), "--max-num-seqs", "2",
                       "--max-model-len", "256", "--openai-port", "0", "--work-dir", str(tmp_path / "work")) as served:
        assert _chat_once(served.openai_port())
        assert served.stop() == 0, served.tail()
