"""The controller's current groups as a `torch.distributed.device_mesh.DeviceMesh`. Runs in a
worker (`Controller.device_mesh`).

World rank r of a decision sits at mesh coordinates (dp, pp, tp) = `Mesh.coords(r)`, row-major
(``r = dp * pp_size * tp_size + pp * tp_size + tp``), so the mesh is ``arange(size)`` in the
shape ``(dp, pp, tp)`` and each dimension's group is the controller's group of that name. A
recovery destroys the groups; the controller builds a new mesh over the new ones
(`Controller.device_mesh`), so code that holds a mesh must take it again after a recovery
(docs/elastic.md, "DeviceMesh").
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from resilient_comm.elastic.model.policy import Mesh

if TYPE_CHECKING:
    import torch.distributed as dist
    from torch.distributed.device_mesh import DeviceMesh

DIM_NAMES = ("dp", "pp", "tp")


def forget_meshes() -> None:
    """Empty DTensor's caches of sharding decisions and redistribution plans. A DeviceMesh
    compares (and hashes) by its ranks, layout and dim names, not by its groups, so a new mesh
    over new groups with the old shape *equals* the old one, and a cached plan of the old mesh
    -- holding the names of its destroyed groups -- would be found for the new mesh's tensors
    ("Could not resolve the process group registered under the name ...")."""
    from torch.distributed.tensor import DTensor, _redistribute

    prop = DTensor._op_dispatcher.sharding_propagator
    for name in ("propagate_op_sharding", "_propagate_tensor_meta_cached"):
        clear = getattr(getattr(prop, name, None), "cache_clear", None)
        if clear is not None:
            clear()
    if hasattr(torch._C, "_clear_DTensor_sharding_propagator_cache"):
        torch._C._clear_DTensor_sharding_propagator_cache()  # the C++ fast path's
    if hasattr(_redistribute, "clear_redistribute_planner_cache"):
        _redistribute.clear_redistribute_planner_cache()


def build(
    dp: dist.ProcessGroup, pp: dist.ProcessGroup, tp: dist.ProcessGroup, mesh: Mesh, device_type: str
) -> DeviceMesh:
    """A 3-D DeviceMesh (dims `DIM_NAMES`, a dimension of size 1 included) over the groups of
    each dimension. DTensor's caches are emptied first (`forget_meshes`): the previous mesh's
    groups are gone."""
    from torch.distributed.device_mesh import DeviceMesh

    forget_meshes()

    layout = torch.arange(mesh.size, dtype=torch.int).reshape(mesh.dp, mesh.pp, mesh.tp)
    return DeviceMesh.from_group([dp, pp, tp], device_type, mesh=layout, mesh_dim_names=DIM_NAMES)


__all__ = ["DIM_NAMES", "build", "forget_meshes"]
