"""Where the heavy actors run on a Ray cluster: placement groups for trainer ranks and engines.

A pool's workers are cut into groups of `group` consecutive workers (a tensor-parallel group); each
group is one STRICT_PACK placement group, so its ranks share a node. An engine spanning several GPUs
is one worker with `gpus=k`. Colocated (`colocate_with="trainer"`): worker i shares bundle i of the
host pool, the same GPU (weight sync over CUDA IPC). Custom Ray resources pin a pool to the nodes
that carry them (`placement.trainer_resources: {trainer_node: 0.01}`).

All-or-nothing and bounded in time: a cluster that cannot hold a group makes `Placement(...)` raise
naming the pool, the bundles and what the cluster has, never leaves actors pending forever.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field

from stages.keys import NONNEG, POSITIVE, key, one_of, section


@section("placement")
class PlacementConfig:
    """The `placement:` recipe section. mode none: actors as today (local Ray, no groups)."""
    mode: str = key("none", "none | disaggregated (own GPUs per role) | colocated (engines on trainer GPUs)",
                            one_of("none", "disaggregated", "colocated"))
    trainer_gpus: float = key(1.0, "GPUs per trainer rank (colocated: its share of the GPU)", NONNEG)
    engine_gpus: float = key(1.0, "GPUs per engine: GPUs it spans (colocated: its share of the trainer rank's GPU)",
                                  NONNEG)
    cpus: float = key(1.0, "CPUs per worker (fractions allowed)", NONNEG)
    timeout_s: float = key(300.0, "how long to wait for the cluster to hold every group", POSITIVE)
    trainer_resources: dict[str, float] = key({}, "custom Ray resources per trainer rank, e.g. {trainer_node: 0.01}: "
                                                  "only nodes that carry them host the role")
    engine_resources: dict[str, float] = key({}, "custom Ray resources per engine: only nodes that carry them host the"
                                                 " role")

    def __post_init__(self):
        if self.mode == "colocated" and self.trainer_gpus + self.engine_gpus > 1:
            raise ValueError("placement.mode=colocated shares one GPU: trainer_gpus + engine_gpus must be <= 1")
        for role, res in (("trainer", self.trainer_resources), ("engine", self.engine_resources)):
            if any(k in ("CPU", "GPU") or not isinstance(v, (int, float)) or v <= 0 for k, v in res.items()):
                raise ValueError(f"placement.{role}_resources: custom resource names with amounts > 0 "
                                 f"(CPU and GPU are set by cpus and {role}_gpus), got {res}")


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
        from ray.util.placement_group import placement_group

        bundles = []
        for i in range(g * host.group, (g + 1) * host.group):
            res = {"CPU": host.cpus, "GPU": host.gpus, **host.resources}
            if guest is not None and i < guest.workers:    # the guest's worker i rides in bundle i
                for k, v in {"CPU": guest.cpus, "GPU": guest.gpus, **guest.resources}.items():
                    res[k] = res.get(k, 0) + v
            bundles.append({k: v for k, v in res.items() if v > 0})
        return placement_group(bundles, strategy="STRICT_PACK", name=f"{host.name}-{g}")

    def _wait(self, name: str, left_s: float, timeout_s: float) -> None:
        import ray

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
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        p = self.pools[pool]
        host = self.pools[p.colocate_with] if p.colocate_with else p
        pgs = self.groups[host.name]
        return [{"num_cpus": p.cpus, **({"num_gpus": p.gpus} if p.gpus else {}),
                 "scheduling_strategy": PlacementGroupSchedulingStrategy(
                     placement_group=pgs[i // host.group], placement_group_bundle_index=i % host.group)}
                for i in range(p.workers)]

    def remove(self) -> None:
        from ray.util.placement_group import remove_placement_group

        for pg in sum(self.groups.values(), []):
            remove_placement_group(pg)
        self.groups = {}
