"""The serving benchmark (`specserve bench`, `make bench`).

    workload.py   the request mix: prompts by length bucket, output lengths, deterministic by seed
    events.py     what the driver records per request (send time, each response's arrival)
    metrics.py    pure functions from those records to TTFT / TPOT / ITL / E2E / throughput
    runner.py     gRPC streaming driver: closed loop at concurrency C, open loop at rate λ;
                  methods interleaved round-robin in one run
    peers.py      transformers generate / prompt lookup / assisted generation on the same prompts
    report.py     JSON, Markdown and PNG plots
    command.py    the command line (`specserve bench`, `clients/bench.py`)
"""
