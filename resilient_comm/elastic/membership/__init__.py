"""The membership: the store protocol every process of the job speaks (node agents and
workers). `protocol.Membership` (epochs, decisions, failure reports, events, node records),
`keys` (names, seals, reads), `joins` (the join records) and `etcd` (an etcd cluster as the
store: `etcd.store.EtcdStore`, and the agents' watch streams, `etcd.watch`).

Imports the model only; `node` and `worker` import it.
"""
