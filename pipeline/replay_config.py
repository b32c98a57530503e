"""The `replay:` recipe section, apart from pipeline/replay.py (which imports pyarrow) so that a
recipe is checked in a fraction of a second."""
from __future__ import annotations

from dataclasses import dataclass

from stages.keys import key


@dataclass(frozen=True)
class ReplayConfig:
    """Which recorded groups to train on (empty / None = no filter)."""
    steps: tuple[int, ...] = key((), "recorded step numbers to train on (empty = all)")
    data_sources: tuple[str, ...] = key((), "data_source values to train on (empty = all)")
    reward_min: float | None = key(None, "inclusive lower bound on a group's mean reward (None = no bound)")
    reward_max: float | None = key(None, "inclusive upper bound on a group's mean reward (None = no bound)")
