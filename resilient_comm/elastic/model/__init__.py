"""The elastic model: what the job's processes agree on, as pure code (no I/O, no
torch.distributed). The mesh and the shrink policy (`policy`), the membership's records
(`records`), an epoch's decision (`decide`), the dead-vs-slow bounds (`bounds`), the recovery
timeline (`timeline`), the node-local channel's lines (`channel`) and the environment a
launcher gives its workers (`env`).

Every other layer imports it; it imports none of them.
"""
