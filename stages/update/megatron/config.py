"""The `megatron:` section of a recipe: how the Megatron-core trainer splits the model.

Kept free of megatron imports so a recipe can be parsed (and rejected) on a machine
without megatron-core installed.
"""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class MegatronConfig:
    tensor_parallel: int = 1          # TP: each layer's matmuls split over this many ranks
    pipeline_parallel: int = 1        # PP: layers split into this many stages
    data_parallel: int = 1            # DP: model replicas; ranks = tensor x pipeline x data
    micro_batch_size: int = 0         # rows per forward/backward on a rank; 0 = the rank's whole mini-batch
    use_distributed_optimizer: bool = False   # ZeRO-1: optimizer state sharded over DP ranks
    recompute_activations: bool = False       # full activation recompute (memory for compute)
    device: str = "auto"              # auto | cuda | cpu ("auto": cuda when the rank sees a GPU)
    timeout_s: float = 600.0          # every collective; a dead peer surfaces as an error, not a hang

    def __post_init__(self):
        for key in ("tensor_parallel", "pipeline_parallel", "data_parallel"):
            if getattr(self, key) < 1:
                raise ValueError(f"megatron.{key} must be >= 1, got {getattr(self, key)}")
        if self.micro_batch_size < 0:
            raise ValueError(f"megatron.micro_batch_size must be >= 0, got {self.micro_batch_size}")
        if self.device not in ("auto", "cuda", "cpu"):
            raise ValueError(f"megatron.device must be auto, cuda or cpu, got {self.device!r}")
        if self.timeout_s <= 0:
            raise ValueError(f"megatron.timeout_s must be > 0, got {self.timeout_s}")

    @property
    def world_size(self) -> int:
        return self.tensor_parallel * self.pipeline_parallel * self.data_parallel
