"""Reliability through real servers (issue 14): many concurrent streams, cancels that free their
slots, a bad request beside good ones, overload refused with a message, and graceful shutdown
of `specserve serve` on SIGTERM.

The checkpoint is a tiny random Qwen2 without EOS, so a request runs exactly max_tokens tokens.
Nothing here asserts on timing: long requests (1000+ tokens) only make sure that requests are
still in flight while the test does the next thing, and every wait is for an event. Where a
request must provably still be in flight (through a shutdown), the engine is held
(SPECSERVE_TEST_HOLD_FILE: while the file exists it decodes nothing) instead of raced.
"""

from __future__ import annotations

import os
import queue
import signal
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from conftest import make_served_checkpoint, running_server
from specserve.serving.verifier_service import HOLD_FILE_ENV
from specserve.triton.client import CompletionError, StreamClient, build_inputs
from specserve.triton.launch import Ports
from specserve.serving.settings import DeploymentSettings
from specserve.triton.render import render_repository
from streams import during_streams, scrape_metrics

pytestmark = pytest.mark.triton

LONG = 1200  # tokens: far longer than anything the test does while such a request runs
DRAINED = 128  # tokens of the streams a drain waits for: the hold file, not their length, keeps them in flight


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return make_served_checkpoint(tmp_path_factory.mktemp("rel_ckpt"), "qwen2", seed=8, max_position_embeddings=2048,
                                  eos_token_id=None)


@pytest.fixture(scope="module")
def server(ckpt, tmp_path_factory):
    root = tmp_path_factory.mktemp("rel_server")
    repo = render_repository(DeploymentSettings(ckpt, max_num_seqs=8, max_model_len=2048, max_queue_len=64,
                                                draft_policy="fixed"),
                             root / "model_repository")
    with running_server(repo, root) as srv:
        yield srv


def wait_for_metrics(url: str, want: dict[str, float], timeout: float = 60.0) -> dict[str, float]:
    """Until every metric in `want` reads its value (they are reported asynchronously, from a
    worker thread, so a read right after the event may not show it yet)."""
    deadline = time.monotonic() + timeout
    while True:
        now = scrape_metrics(url)
        if all(now.get(k) == v for k, v in want.items()):
            return now
        assert time.monotonic() < deadline, f"gauges {want} never reached: {now}"
        time.sleep(0.2)


def gen(url: str, prompt: str, params: dict, **kw):
    return StreamClient(url).generate(prompt, params, **kw)


def test_64_concurrent_streams_with_mixed_methods_each_equal_their_solo_none_output(server):
    jobs = [(f"stream {i}: " + "a b c " * (i % 5), 24, ("none", "ngram")[i % 2]) for i in range(64)]
    solo = {p: gen(server.grpc_url, p, {"max_tokens": n, "spec_method": "none"}).text for p, n, _ in jobs}
    barrier = threading.Barrier(64)

    def run(job):
        prompt, n, method = job
        client = StreamClient(server.grpc_url)
        barrier.wait()
        return client.generate(prompt, {"max_tokens": n, "spec_method": method}, timeout=300).text

    with ThreadPoolExecutor(64) as pool:
        together = list(pool.map(run, jobs))
    assert together == [solo[p] for p, _, _ in jobs]


def test_cancelling_half_of_16_streams_frees_their_slots(server):
    import tritonclient.grpc as grpcclient
    streams = []
    for i in range(16):
        client = grpcclient.InferenceServerClient(server.grpc_url)
        results: queue.Queue = queue.Queue()
        client.start_stream(callback=lambda result, error, q=results: q.put((result, error)))
        client.async_stream_infer("llm", build_inputs(f"cancel test {i}", {"max_tokens": 60 if i % 2 else LONG}),
                                  enable_empty_final_response=True)
        streams.append((client, results))
    for i, (client, results) in enumerate(streams):
        if i % 2 == 0:
            assert results.get(timeout=120)[1] is None   # it is streaming
            client.stop_stream(cancel_requests=True)
    for i, (client, results) in enumerate(streams):
        if i % 2:
            while True:   # the other half runs to its end
                result, error = results.get(timeout=300)
                assert error is None
                if result.get_response().parameters["triton_final_response"].bool_param:
                    break
            client.stop_stream()
    wait_for_metrics(server.metrics_url, {"specserve_num_requests_running": 0, "specserve_num_slots_used": 0,
                                         "specserve_num_requests_waiting": 0})
    with ThreadPoolExecutor(16) as pool:
        outs = list(pool.map(lambda i: gen(server.grpc_url, f"after {i}", {"max_tokens": 8}), range(16)))
    assert all(o.num_output_tokens == 8 and o.finish_reason == "length" for o in outs)
    wait_for_metrics(server.metrics_url, {"specserve_num_requests_running": 0, "specserve_num_slots_used": 0})


def test_a_nan_temperature_request_beside_four_streams_fails_alone(server):
    prompts = [f"neighbour {i}" for i in range(4)]
    want = {p: gen(server.grpc_url, p, {"max_tokens": 128}).text for p in prompts}

    def bad_request():
        with pytest.raises(CompletionError, match=r"temperature must be a finite number >= 0, got nan"):
            StreamClient(server.grpc_url).generate("bad", '{"temperature": NaN, "max_tokens": 50}')

    results, _ = during_streams(lambda p, on_chunk: StreamClient(server.grpc_url).generate(
        p, {"max_tokens": 128}, on_chunk=on_chunk), prompts, bad_request)   # once all four are streaming
    got = [r.text for r in results]
    assert got == [want[p] for p in prompts]


# -- specserve serve as a user runs it: overload and SIGTERM ------------------------------------
class Served:
    """`specserve serve` in a subprocess on fresh ports (started again if a port was taken). With
    `hold`, the engine decodes nothing while that file exists."""

    def __init__(self, ckpt: Path, work: Path, *args: str, hold: Path | None = None):
        env = {**os.environ, **({HOLD_FILE_ENV: str(hold)} if hold is not None else {})}
        for _ in range(5):
            self.ports = Ports.free()
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "specserve.cli.main", "serve", "--target", str(ckpt),
                 "--http-port", str(self.ports.http), "--grpc-port", str(self.ports.grpc),
                 "--metrics-port", str(self.ports.metrics), "--work-dir", str(work), *args],
                stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
            self.lines: list[str] = []
            for line in self.proc.stdout:
                self.lines.append(line)
                if line.startswith("specserve: ready"):
                    threading.Thread(target=self._drain_output, daemon=True).start()
                    return
            self.proc.wait(30)
            if not any("in use" in x or "could not bind" in x for x in self.lines):
                break
        raise AssertionError("specserve serve did not start:\n" + "".join(self.lines[-30:]))

    def _drain_output(self):
        for line in self.proc.stdout:
            self.lines.append(line)

    @property
    def grpc_url(self) -> str:
        return f"localhost:{self.ports.grpc}"

    def ready(self) -> int:
        try:
            with urllib.request.urlopen(f"http://localhost:{self.ports.http}/v2/health/ready", timeout=5) as r:
                return r.status
        except urllib.error.HTTPError as e:
            return e.code

    def stop(self):
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(30)


REFUSED_AFTER_SIGTERM = ("the server is shutting down and accepts no new requests; retry on another replica",
                         "Request for unknown model: 'llm' has no available versions")


def test_overload_is_refused_at_once_and_sigterm_drains_streams_to_their_end(ckpt, tmp_path):
    # The drain time is far beyond what the streams need: they are to end by finishing, not by it.
    hold = tmp_path / "hold"
    served = Served(ckpt, tmp_path / "work", "--max-num-seqs", "2", "--max-queue-len", "2",
                    "--drain-timeout", "600", hold=hold)
    try:
        prompts = [f"drain {i}" for i in range(4)]
        want = {p: gen(served.grpc_url, p, {"max_tokens": DRAINED}, timeout=300) for p in prompts}
        metrics_url = f"http://localhost:{served.ports.metrics}/metrics"
        hold.touch()   # the streams below stay in flight, a few tokens long, until it is removed

        def overload_then_sigterm():
            # Two are streaming; the other two hold the queue's 2 places.
            wait_for_metrics(metrics_url, {"specserve_num_requests_running": 2, "specserve_num_requests_waiting": 2})
            for _ in range(2):
                with pytest.raises(CompletionError, match=r"server busy: 2 requests are already waiting for one "
                                                          r"of 2 slots \(max_queue_len=2\); retry later"):
                    gen(served.grpc_url, "one too many", {"max_tokens": 4})
            wait_for_metrics(metrics_url, {'specserve_request_rejected_total{reason="busy"}': 2})

            served.proc.send_signal(signal.SIGTERM)
            deadline = time.monotonic() + 60
            while served.ready() == 200:   # not ready as soon as the drain starts
                assert time.monotonic() < deadline, "still ready after SIGTERM"
                time.sleep(0.1)
            with pytest.raises(CompletionError) as err:
                gen(served.grpc_url, "too late", {"max_tokens": 4}, timeout=30)
            assert any(m in str(err.value) for m in REFUSED_AFTER_SIGTERM), str(err.value)
            hold.unlink()

        got, _ = during_streams(lambda p, on_chunk: StreamClient(served.grpc_url).generate(
            p, {"max_tokens": DRAINED}, timeout=300, on_chunk=on_chunk), prompts, overload_then_sigterm, started=2)
        for p, g in zip(prompts, got):   # every in-flight stream ran to its end, unchanged
            assert (g.text, g.num_output_tokens, g.finish_reason) == (want[p].text, DRAINED, "length")
        assert served.proc.wait(90) == 0, "".join(served.lines[-40:])
        out = "".join(served.lines)
        assert "specserve: draining (up to 600 s for in-flight requests)" in out and "drained" in out
    finally:
        hold.unlink(missing_ok=True)
        served.stop()


def test_a_lost_engine_model_is_reloaded_and_sigterm_ends_what_outlives_the_drain_time(ckpt, tmp_path):
    import tritonclient.grpc as grpcclient
    from tritonclient.utils import InferenceServerException

    from specserve.serving.auth import grpc_headers
    hold = tmp_path / "hold"
    served = Served(ckpt, tmp_path / "work", "--drain-timeout", "1", hold=hold)
    try:
        want = gen(served.grpc_url, "after the reload", {"max_tokens": 16}).text
        # Model control is closed to clients; with the admin key an operator can unload the engine...
        client = grpcclient.InferenceServerClient(served.grpc_url)
        with pytest.raises(InferenceServerException, match="This protocol is restricted"):
            client.unload_model("target_verifier")
        client.unload_model("target_verifier",
                            headers=grpc_headers((tmp_path / "work" / "admin_key").read_text().strip()))
        # ...and serve notices, reports not ready while it reloads llm (and so the engine), then serves again.
        deadline = time.monotonic() + 180
        while "specserve: 'llm' is ready again\n" not in served.lines:
            assert time.monotonic() < deadline, "".join(served.lines[-20:])
            time.sleep(0.2)
        assert "specserve: 'llm' is not ready (a model it needs was unloaded); the server reports not ready " \
               "while it is loaded again\n" in served.lines
        assert served.ready() == 200
        assert gen(served.grpc_url, "after the reload", {"max_tokens": 16}).text == want

        started, result = threading.Event(), queue.Queue()
        # Held from its submit on, the request gets its first token and no more: it outlives the
        # drain time whatever the machine's load.
        hold.touch()

        def run():
            try:
                result.put(StreamClient(served.grpc_url).generate("long", {"max_tokens": 2000}, timeout=300,
                                                                  on_chunk=lambda c: started.set()))
            except CompletionError as e:
                result.put(e)

        threading.Thread(target=run, daemon=True).start()
        assert started.wait(120)
        served.proc.send_signal(signal.SIGTERM)
        got = result.get(timeout=120)
        assert isinstance(got, CompletionError) and str(got) == (
            "in ensemble 'llm', the server is shutting down: its drain time ran out before this request finished")
        assert served.proc.wait(90) == 0, "".join(served.lines[-40:])
        assert "drain time over; ending 1 request(s) with an error" in "".join(served.lines)
    finally:
        hold.unlink(missing_ok=True)
        served.stop()
