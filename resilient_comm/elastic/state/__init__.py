"""A worker's training state: the state provider and `TrainState` (`provider`), copying a
state between members as tensors (`transfer`), FSDP2 checkpoints re-sharded onto a new mesh
(`reshard`) and the groups as a DeviceMesh (`devicemesh`).

Imports the model only; the worker imports it.
"""
