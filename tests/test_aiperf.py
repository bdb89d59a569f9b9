"""AIPerf (NVIDIA's benchmark client) against the OpenAI API that `specserve serve --openai-port`
starts: its chat endpoint type, streaming, 8 requests, on a tiny checkpoint with a chat template
(the demo model has none, so its chat endpoint refuses). AIPerf runs from its own venv
(.venv-aiperf, made by `make aiperf`: its pins would disturb ours); without it the test skips,
saying so. Checked in AIPerf's own export: every request succeeded, each one's completion tokens
are what it asked for (ignore_eos) as our usage reports them, and each has a time to first token."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import make_served_checkpoint, serve_process

pytestmark = [pytest.mark.triton, pytest.mark.slow]

ROOT = Path(__file__).resolve().parents[1]
AIPERF = ROOT / ".venv-aiperf" / "bin" / "aiperf"
TEMPLATE = ("{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
            "{% if add_generation_prompt %}assistant:{% endif %}")
REQUESTS, OUTPUT_TOKENS = 8, 12


@pytest.mark.skipif(not AIPERF.exists(), reason="AIPerf is not installed: `make aiperf` puts it in .venv-aiperf")
def test_aiperf_chat_streaming(tmp_path):
    ckpt = make_served_checkpoint(tmp_path / "tiny-chat", seed=3)
    (ckpt / "tokenizer_config.json").write_text(json.dumps({"chat_template": TEMPLATE, "eos_token": "</s>"}))
    art = tmp_path / "aiperf"
    with serve_process([sys.executable, "-m", "specserve.cli.main"], "--target", str(ckpt), "--max-num-seqs", "2",
                       "--max-model-len", "256", "--openai-port", "0", "--work-dir", str(tmp_path / "work")) as served:
        port = served.openai_port()
        # The tokenizer is the checkpoint's folder; token counts are the server's usage. (With
        # HF_HUB_OFFLINE=1 aiperf 0.13.0 refuses a local tokenizer folder as an invalid repo id.)
        done = subprocess.run(
            [str(AIPERF), "profile", "--model", ckpt.name, "--url", f"http://127.0.0.1:{port}",
             "--endpoint-type", "chat", "--streaming", "--tokenizer", str(ckpt),
             "--request-count", str(REQUESTS), "--concurrency", "2", "--random-seed", "0",
             "--prompt-input-tokens-mean", "16", "--prompt-output-tokens-mean", str(OUTPUT_TOKENS),
             "--prompt-output-tokens-stddev", "0", "--extra-inputs", "ignore_eos:true",
             "--use-server-token-count", "--output-artifact-dir", str(art), "--ui-type", "none"],
            capture_output=True, text=True, cwd=tmp_path)
        assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
        assert served.stop() == 0, served.tail()
    summary = json.loads((art / "profile_export_aiperf.json").read_text())
    assert summary["request_count"]["avg"] == REQUESTS
    assert summary["error_summary"] == [] and summary["request_error_rate"]["avg"] == 0
    records = [json.loads(line)["metrics"] for line in (art / "profile_export.jsonl").read_text().splitlines()]
    assert len(records) == REQUESTS
    for m in records:
        assert m["usage_completion_tokens"]["value"] == OUTPUT_TOKENS
        assert m["output_token_count"]["value"] == OUTPUT_TOKENS
        assert m["time_to_first_token"]["value"] > 0
