#!/usr/bin/env python3
"""The serving benchmark as a script; the same as `specserve bench` (see specserve/cli/bench/).

    python clients/bench.py --quick                       # start a server on the demo model
    python clients/bench.py --url localhost:8001 --methods none,ngram --concurrency 1,4,8
"""

from specserve.cli.bench.command import main

if __name__ == "__main__":
    main()
