"""Where the heavy actors run on a Ray cluster: placement groups for trainer ranks and engines.

    placement = Placement([Pool("trainer", workers=8, gpus=1, group=2),       # TP groups of 2
                           Pool("rollout", workers=4, gpus=2)])               # SGLang engines, TP 2
    trainer_opts = placement.options("trainer")      # one dict of Ray actor options per worker
    ...
    placement.remove()

A pool's workers are cut into groups of `group` consecutive workers (a tensor-parallel
group: megatron numbers TP ranks fastest); each group is one STRICT_PACK placement group,
so its ranks share a node and talk over NVLink, while groups (DP replicas, pipeline
stages) may land on different nodes. An engine that spans several GPUs is one worker
with `gpus=k` in one bundle: SGLang starts its TP processes inside the actor's GPUs.

Colocated mode (`colocate_with="trainer"`): worker i of the pool shares bundle i of the
host pool, i.e. the same GPU (trainer and engine take a fraction each), which is what
lets weight sync use CUDA IPC instead of the network.

Custom Ray resources pin a pool to the nodes that carry them: a node started with
`ray start --resources='{"trainer_node": 1}'` and `placement.trainer_resources:
{trainer_node: 0.01}` puts every trainer rank there (each bundle asks for that much).

The placement is all-or-nothing and bounded in time: if the cluster cannot hold a group,
`Placement(...)` raises naming the pool, the bundles and what the cluster has, instead
of leaving actors pending forever.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field

import ray
from ray.util.placement_group import placement_group, remove_placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from pipeline.placement_config import PlacementConfig


@dataclass(frozen=True)
class Pool:
    name: str
    workers: int
    cpus: float = 1.0           # per worker
    gpus: float = 0.0           # per worker
    group: int = 1              # consecutive workers that must share a node
    colocate_with: str = ""     # host pool: worker i shares its bundle i
    resources: dict[str, float] = field(default_factory=dict)     # custom Ray resources per worker

    def __post_init__(self):
        if self.workers < 1 or self.group < 1 or self.workers % self.group:
            raise ValueError(f"pool {self.name}: group={self.group} must divide workers={self.workers}")


def plan_pools(cfg: PlacementConfig, trainer_ranks: int, trainer_group: int, engines: int) -> list[Pool]:
    """The two pools of a recipe: trainer ranks in TP groups, and the rollout engines."""
    trainer = Pool("trainer", trainer_ranks, cfg.cpus, cfg.trainer_gpus, trainer_group,
                   resources=dict(cfg.trainer_resources))
    host = "trainer" if cfg.mode == "colocated" else ""
    return [trainer, Pool("rollout", engines, cfg.cpus, cfg.engine_gpus, colocate_with=host,
                          resources=dict(cfg.engine_resources))]


class Placement:
    def __init__(self, pools: list[Pool], timeout_s: float = 300.0):
        self.pools = {p.name: p for p in pools}
        self.groups: dict[str, list] = {}           # host pool -> its placement groups
        hosts = [p for p in pools if not p.colocate_with]
        guests = {p.colocate_with: p for p in pools if p.colocate_with}
        for p in pools:
            if p.colocate_with and (p.colocate_with not in self.pools or p.group != 1
                                    or p.workers > self.pools[p.colocate_with].workers):
                raise ValueError(f"pool {p.name} colocates with {p.colocate_with!r}: needs that pool, one bundle "
                                 f"per worker and at most as many workers as it has")
        # Biggest groups first, each pool placed before the next is asked for: a pool of small
        # groups placed first can spread over the nodes and leave no node room for a big group.
        hosts.sort(key=lambda p: (p.group * p.gpus, p.group * p.cpus), reverse=True)
        deadline = time.monotonic() + timeout_s
        try:
            for host in hosts:
                self.groups[host.name] = [self._group(host, g, guests.get(host.name))
                                          for g in range(host.workers // host.group)]
                self._wait(host.name, max(deadline - time.monotonic(), 0.0), timeout_s)
        except BaseException:
            self.remove()
            raise

    def _group(self, host: Pool, g: int, guest: Pool | None):
        bundles = []
        for i in range(g * host.group, (g + 1) * host.group):
            res = {"CPU": host.cpus, "GPU": host.gpus, **host.resources}
            if guest is not None and i < guest.workers:    # the guest's worker i rides in bundle i
                for k, v in {"CPU": guest.cpus, "GPU": guest.gpus, **guest.resources}.items():
                    res[k] = res.get(k, 0) + v
            bundles.append({k: v for k, v in res.items() if v > 0})
        return placement_group(bundles, strategy="STRICT_PACK", name=f"{host.name}-{g}")

    def _wait(self, name: str, left_s: float, timeout_s: float) -> None:
        pgs = self.groups[name]
        ready, pending = ray.wait([pg.ready() for pg in pgs], num_returns=len(pgs), timeout=left_s)
        if pending:
            pool = self.pools[name]
            raise TimeoutError(
                f"placement: the cluster could not hold pool {name!r} within {timeout_s:.0f}s: "
                f"{len(pending)} of {len(pgs)} groups of {pool.group} x {pgs[0].bundle_specs[0]} on one node "
                f"are pending; the cluster has {ray.cluster_resources()}")

    def options(self, pool: str) -> list[dict]:
        """Ray actor options (resources + bundle) for each worker of `pool`, in order."""
        p = self.pools[pool]
        host = self.pools[p.colocate_with] if p.colocate_with else p
        out = []
        for i in range(p.workers):
            pg = self.groups[host.name][i // host.group]
            opt = {"num_cpus": p.cpus, "scheduling_strategy": PlacementGroupSchedulingStrategy(
                placement_group=pg, placement_group_bundle_index=i % host.group)}
            if p.gpus:
                opt["num_gpus"] = p.gpus
            out.append(opt)
        return out

    def remove(self) -> None:
        for pgs in self.groups.values():
            for pg in pgs:
                remove_placement_group(pg)
        self.groups = {}
