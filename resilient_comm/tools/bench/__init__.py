"""Benchmarks for resilient_comm (``resilient-comm bench <name>``; tables in benchmarks/README.md).

- :mod:`~resilient_comm.tools.bench.collectives`: latency and bandwidth of the CPU collectives of
  ``resilient_tcp`` against gloo, in the same worker processes.
- :mod:`~resilient_comm.tools.bench.integrity`: what the replicas' fingerprint comparison (silent
  data corruption) costs per step of the demo's training, against the same job without it.
- :mod:`~resilient_comm.tools.bench.nccl_path`: the NCCL code path's overlap on the NCCL emulator
  (async calls that return at once, ops in flight together) against resilient_tcp and gloo.
- :mod:`~resilient_comm.tools.bench.overhead`: ``dist.all_reduce`` on ``resilient_tcp`` against the
  bare communicator and against gloo.
- :mod:`~resilient_comm.tools.bench.primitives`: init, abort, shrink (against a full re-init), split
  and grow latency, measured by the C++ program in benchmarks/cpp.
- :mod:`~resilient_comm.tools.bench.reconfigure`: SIGKILL to the first correct all_reduce through
  torch's own reconfigure API (torch >= 2.14) on gloo, resilient_tcp and the NCCL emulator.
- :mod:`~resilient_comm.tools.bench.recovery`: SIGKILL to the first committed step with the elastic
  controller, against a torchrun restart from checkpoint.
"""
