"""The `batcher:` recipe section (pipeline/window.py uses it), apart so a recipe is checked without pyarrow."""
from __future__ import annotations

from stages.keys import POSITIVE, key, one_of, section


@section("batcher")
class BatcherConfig:
    groups_per_step: int = key(8, "B: prompt groups per training step", POSITIVE)
    filter_equal_rewards: bool = key(False, "dynamic sampling: drop groups whose rewards are all equal")
    stale_policy: str = key("drop", "drop | wait | mask: what to do with a group older than the bound (mask: its "
                                    "tokens older than the bound leave the loss, kept as context; the group is dropped"
                                    " only when none is left: long trajectories are not starved)",
                                    one_of("drop", "wait", "mask"))
