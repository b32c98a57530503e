"""The `placement:` recipe section (pipeline/placement.py makes the placement groups it describes).

Apart from pipeline/placement.py, which imports Ray, so a recipe is checked without Ray.
"""
from __future__ import annotations

from dataclasses import dataclass

from stages.keys import NONNEG, POSITIVE, key, one_of


@dataclass(frozen=True)
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
        if self.mode not in ("none", "disaggregated", "colocated"):
            raise ValueError(f"placement.mode must be none, disaggregated or colocated, got {self.mode!r}")
        if self.mode == "colocated" and self.trainer_gpus + self.engine_gpus > 1:
            raise ValueError("placement.mode=colocated shares one GPU: trainer_gpus + engine_gpus must be <= 1")
        if min(self.trainer_gpus, self.engine_gpus, self.cpus) < 0 or self.timeout_s <= 0:
            raise ValueError("placement: resources must be >= 0 and timeout_s > 0")
        for role, res in (("trainer", self.trainer_resources), ("engine", self.engine_resources)):
            if any(k in ("CPU", "GPU") or not isinstance(v, (int, float)) or v <= 0 for k, v in res.items()):
                raise ValueError(f"placement.{role}_resources: custom resource names with amounts > 0 "
                                 f"(CPU and GPU are set by cpus and {role}_gpus), got {res}")
