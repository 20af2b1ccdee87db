"""Benchmarks for resilient_comm.

- :mod:`resilient_comm.bench.collectives`: latency and bandwidth of the CPU collectives of the
  ``resilient_tcp`` backend against gloo, measured in the same worker processes
  (``resilient-comm bench collectives`` or ``python benchmarks/collectives.py``).
"""
