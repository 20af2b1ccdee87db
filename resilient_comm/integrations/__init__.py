"""Integrations with training frameworks: `lightning` (a Lightning DDP strategy and cluster
environment that survive ``resilient-run --in-process`` restarts). Accelerate needs none: the
in-process restarter resets its process-wide state (`elastic.worker.inprocess`)."""
