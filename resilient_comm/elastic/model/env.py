"""What a node agent and its workers agree on without a message: the environment
``resilient-run`` (`node.launcher`) sets in every worker, and the exit status of a worker
the membership evicted. Constants only: both processes import them from here.
"""

from __future__ import annotations

ENV_STORE = "RESILIENT_COMM_STORE"  # the job's store: host:port (the launcher's) or etcd://h1:p1,h2:p2
ENV_NAMESPACE = "RESILIENT_COMM_NAMESPACE"  # this run's key prefix in it
ENV_SPARE = "RESILIENT_COMM_SPARE"  # "1" in a hot spare (its RANK is a spare id >= WORLD_SIZE)
ENV_AGENT = "RESILIENT_COMM_AGENT"  # path of the node agent's socket, in every worker's environment
ENV_TOKEN = "RESILIENT_COMM_TOKEN"  # the job token (docs/security.md): never on the store
EXIT_EVICTED = 3  # exit status of a worker the membership evicted (the launcher ignores it)

__all__ = ["ENV_AGENT", "ENV_NAMESPACE", "ENV_SPARE", "ENV_STORE", "ENV_TOKEN", "EXIT_EVICTED"]
