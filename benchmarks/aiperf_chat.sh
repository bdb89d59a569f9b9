#!/usr/bin/env bash
# AIPerf's chat endpoint, streaming, against a running `specserve serve --openai-port PORT`.
#
#   make aiperf                                   # AIPerf into .venv-aiperf (its own venv)
#   .venv/bin/specserve serve --target models/smollm2/target --openai-port 8080 &
#   benchmarks/aiperf_chat.sh [URL] [CHECKPOINT] [REQUESTS] [CONCURRENCY]
#
# The tokenizer is the checkpoint folder's; --use-server-token-count makes AIPerf
# count tokens as our usage reports them. The export (profile_export_aiperf.json, one record per
# request in profile_export.jsonl) lands in work_dirs/aiperf. tests/test_aiperf.py runs the same
# on a tiny checkpoint and checks the export.
set -euo pipefail
URL=${1:-http://127.0.0.1:8080}
CKPT=${2:-models/smollm2/target}
REQUESTS=${3:-32}
CONCURRENCY=${4:-1}
exec .venv-aiperf/bin/aiperf profile --model "$(basename "$CKPT")" --url "$URL" \
  --endpoint-type chat --streaming --tokenizer "$CKPT" \
  --request-count "$REQUESTS" --concurrency "$CONCURRENCY" --random-seed 0 \
  --prompt-input-tokens-mean 64 --prompt-output-tokens-mean 64 --use-server-token-count \
  --output-artifact-dir work_dirs/aiperf --ui-type none
