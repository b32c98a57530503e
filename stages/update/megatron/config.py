"""The `megatron:` section of a recipe: how the Megatron-core trainer splits the model. No megatron
import, so a recipe is parsed (and rejected) on a machine without megatron-core.
"""
from __future__ import annotations

from stages.keys import NONNEG, POSITIVE, at_least, key, one_of, section


@section("megatron")
class MegatronConfig:
    tensor_parallel: int = key(1, "TP: each layer's matmuls split over this many ranks", at_least(1))
    pipeline_parallel: int = key(1, "PP: layers split into this many stages", at_least(1))
    data_parallel: int = key(1, "DP: model replicas; ranks = tensor x pipeline x data", at_least(1))
    micro_batch_size: int = key(0, "rows per forward/backward on a rank; 0 = the rank's whole mini-batch", NONNEG)
    use_distributed_optimizer: bool = key(False, "ZeRO-1: optimizer state sharded over DP ranks")
    recompute_activations: bool = key(False, "full activation recompute (memory for compute)")
    device: str = key("auto", 'auto | cuda | cpu ("auto": cuda when the rank sees a GPU)',
                              one_of("auto", "cuda", "cpu"))
    timeout_s: float = key(600.0, "seconds for every collective; a dead peer surfaces as an error, not a hang",
                                  POSITIVE)

    @property
    def world_size(self) -> int:
        return self.tensor_parallel * self.pipeline_parallel * self.data_parallel
