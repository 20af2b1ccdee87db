#!/usr/bin/env python
"""Collectives benchmark, resilient_tcp vs gloo: a thin wrapper around
resilient_comm.tools.bench.collectives (same as `resilient-comm bench collectives`).

    python benchmarks/collectives.py [--quick] [--world-sizes 2,4] [--max-bytes 64M] [--json PATH]

The latest table is in benchmarks/README.md; the method and older runs in
benchmarks/results/collectives.md.
"""

import sys

from resilient_comm.tools.bench.collectives import main

if __name__ == "__main__":  # required: workers are started with the spawn method
    sys.exit(main(sys.argv[1:]))
