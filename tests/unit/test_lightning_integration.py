"""`resilient_comm.integrations.lightning` without processes: after an in-process restart that
shrank the world from 3 to 2, the survivor launched in slot 2 keeps its device (slot 2 of the
node's), its sampler shards by the world of 2, and the environment accepts the smaller world
(stock Lightning refuses it). GPU devices are only named here: nothing runs on them."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("lightning", reason="lightning is not installed: pip install -e '.[frameworks]'")

from lightning.fabric.plugins.environments import TorchElasticEnvironment  # noqa: E402

from resilient_comm.integrations.lightning import ResilientDDPStrategy, ResilientEnvironment  # noqa: E402


@pytest.fixture
def restarted(monkeypatch: pytest.MonkeyPatch) -> None:
    """The environment rank 2 of a 3-process launch has after rank 1's death: world 2, rank 1."""
    for k, v in {"LOCAL_RANK": "2", "LOCAL_WORLD_SIZE": "3", "WORLD_SIZE": "2", "RANK": "1", "GROUP_RANK": "0",
                 "RESILIENT_COMM_AGENT": "/tmp/agent.sock"}.items():
        monkeypatch.setenv(k, v)


def test_a_restarted_process_keeps_its_gpu_and_shards_by_the_world_as_it_is(restarted: None) -> None:
    s = ResilientDDPStrategy(parallel_devices=[torch.device("cuda", i) for i in range(3)])
    assert s.root_device == torch.device("cuda", 2), "the device of its launch slot, not of its new rank"
    assert s._get_process_group_backend() == "resilient_nccl"
    assert s.distributed_sampler_kwargs == {"num_replicas": 2, "rank": 1}
    assert isinstance(s.cluster_environment, ResilientEnvironment) and ResilientEnvironment.detect()
    ResilientEnvironment().validate_settings(num_devices=3, num_nodes=1)
    with pytest.raises(ValueError, match="does not match the world size"):
        TorchElasticEnvironment().validate_settings(num_devices=3, num_nodes=1)  # why the environment exists
    with pytest.raises(ValueError, match="devices=0"):
        ResilientEnvironment().validate_settings(num_devices=0, num_nodes=1)


def test_devices_that_do_not_reach_the_processs_slot_are_a_clear_error(restarted: None) -> None:
    s = ResilientDDPStrategy(parallel_devices=[torch.device("cuda", i) for i in range(2)])
    with pytest.raises(ValueError, match=r"owns device slot 2 of its node .* devices=2: pass the node's devices"):
        _ = s.root_device


def test_on_the_cpu_any_slot_is_the_cpu_and_the_group_resilient_tcp(restarted: None) -> None:
    s = ResilientDDPStrategy(parallel_devices=[torch.device("cpu")] * 2)  # devices=WORLD_SIZE works on the CPU
    assert s.root_device == torch.device("cpu") and s._get_process_group_backend() == "resilient_tcp"
    assert ResilientDDPStrategy(process_group_backend="gloo")._get_process_group_backend() == "gloo"
