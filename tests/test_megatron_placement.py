"""Placement of trainer ranks and engines on a multi-node Ray cluster (pipeline/placement.py).

A local multi-raylet cluster (ray.cluster_utils.Cluster): two nodes with two (logical)
GPUs and one CPU each; workers ask for fractional CPUs. The actors only report where
they run, which is all placement decides.
"""
from __future__ import annotations

import pytest

ray = pytest.importorskip("ray")
from ray.cluster_utils import Cluster  # noqa: E402

from pipeline.placement import Placement, PlacementConfig, Pool, plan_pools  # noqa: E402

OWN_RAY = True      # a two-node Ray cluster of its own: it starts without the shared Ray


@pytest.fixture(scope="module")
def cluster():
    c = Cluster(initialize_head=True, head_node_args={"num_cpus": 1, "num_gpus": 2, "include_dashboard": False})
    c.add_node(num_cpus=1, num_gpus=2)
    ray.init(address=c.address, log_to_driver=False)
    c.wait_for_nodes()
    yield c
    ray.shutdown()
    c.shutdown()


@ray.remote
class Where:
    def where(self) -> tuple[str, tuple]:
        return ray.get_runtime_context().get_node_id(), tuple(ray.get_gpu_ids())


def spots(placement: Placement, pool: str) -> list[tuple[str, tuple]]:
    actors = [Where.options(**o).remote() for o in placement.options(pool)]
    return ray.get([a.where.remote() for a in actors], timeout=120)


def test_each_tp_group_packs_on_one_node(cluster):
    placement = Placement([Pool("trainer", workers=4, cpus=0.2, gpus=1, group=2)], timeout_s=60)
    try:
        where = spots(placement, "trainer")
        nodes = [n for n, _ in where]
        assert nodes[0] == nodes[1] and nodes[2] == nodes[3]      # a TP group never spans nodes
        assert nodes[0] != nodes[2]                                # 4 GPUs in all: both nodes are used
        assert where[0][1] != where[1][1] and where[2][1] != where[3][1]    # one GPU per rank
    finally:
        placement.remove()


def test_colocated_engines_share_their_trainer_rank_gpu(cluster):
    cfg = PlacementConfig(mode="colocated", trainer_gpus=0.5, engine_gpus=0.5, cpus=0.1, timeout_s=60)
    placement = Placement(plan_pools(cfg, trainer_ranks=4, trainer_group=2, engines=4), cfg.timeout_s)
    try:
        trainer, rollout = spots(placement, "trainer"), spots(placement, "rollout")
        assert rollout == trainer                 # engine i: same node and same GPU as rank i
        assert len(set(trainer)) == 4
    finally:
        placement.remove()


def test_disaggregated_pools_take_separate_gpus(cluster):
    cfg = PlacementConfig(mode="disaggregated", trainer_gpus=1, engine_gpus=1, cpus=0.1, timeout_s=60)
    placement = Placement(plan_pools(cfg, trainer_ranks=2, trainer_group=2, engines=2), cfg.timeout_s)
    try:
        trainer, rollout = spots(placement, "trainer"), spots(placement, "rollout")
        assert trainer[0][0] == trainer[1][0]
        assert not set(trainer) & set(rollout)    # no GPU serves both roles
    finally:
        placement.remove()


def test_a_group_larger_than_any_node_fails_fast_and_names_the_pool(cluster):
    with pytest.raises(TimeoutError, match="pool 'trainer'.*groups of 3"):
        Placement([Pool("trainer", workers=3, cpus=0.1, gpus=1, group=3)], timeout_s=5)
    # nothing is left reserved: the whole cluster can be placed again
    placement = Placement([Pool("trainer", workers=4, cpus=0.2, gpus=1, group=2)], timeout_s=60)
    placement.remove()


def test_bad_pools_and_configs_are_rejected():
    with pytest.raises(ValueError, match="group=3 must divide workers=4"):
        Pool("trainer", workers=4, group=3)
    with pytest.raises(ValueError, match="trainer_gpus \\+ engine_gpus must be <= 1"):
        PlacementConfig(mode="colocated", trainer_gpus=0.8, engine_gpus=0.5)
    with pytest.raises(ValueError, match="placement.mode must be"):
        PlacementConfig(mode="spread")
