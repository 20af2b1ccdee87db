"""What the node agent process runs: ``resilient-run`` (`launcher`), which supervises the
node's processes and reaches the job's store through `connection`, and its `agent.NodeAgent`,
which speaks for them to the store: the node-local channel (`channel`), the node's view of its
processes and the ring (`view`), the ring successor's record (`ring`), the events thread
(`events`), the etcd lease and fencing (`lease`), the join batches (`join_batcher`), the
Prometheus metrics (`metrics`), the node's place from the rendezvous (`rendezvous`), the
defaults a Slurm step gives (`slurm`) and the node's health checks (`health`).

Imports the model and the membership; never the worker side (what both need is in `model`).
"""
