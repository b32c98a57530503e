"""The `reward:` recipe section (stages/reward.py reads it), apart so a recipe is checked without pyarrow."""
from __future__ import annotations

from stages.keys import NONNEG, POSITIVE, at_least, key, section


@section("reward")
class RewardConfig:
    fn: str = key("exact_match", "exact_match | numeric | dotted path `pkg.module:function`")
    timeout_s: float = key(10.0, "seconds per row of a user fn, from when a worker starts it", POSITIVE)
    workers: int = key(4, "worker processes for a user fn (k hung rows cost ~ceil(k / workers) timeouts)", at_least(1))
    seed: int = key(0, "set from run.seed (pipeline/seeds.py), not a recipe key: row[\"seed\"] for a user fn", NONNEG)
