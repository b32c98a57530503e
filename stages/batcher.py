"""Windowed batcher: streamed trajectory rows -> one training step's groups.

Input columns: group_id, sample_idx, status, reward, token_versions
Output: a pa.Table of B complete groups (N rows each), ordered by group seq.

Why it exists: rows arrive in whatever order the rollout workers finish; training needs
whole groups (advantages are normalised within a group), at most `stale_steps` versions
old, and in the order the window strategy allows. The bound is enforced here, on the
driver, at the last moment before training: a group older than the bound is dropped and
counted (or, with `stale_policy: wait`, never produced because the gate holds it back).
"""
from __future__ import annotations

from dataclasses import dataclass, field

import pyarrow as pa


@dataclass(frozen=True)
class BatcherConfig:
    groups_per_step: int = 8           # B
    filter_equal_rewards: bool = False  # dynamic sampling: drop groups whose rewards are all equal
    stale_policy: str = "drop"         # drop | wait: what to do with a group older than the bound

    def __post_init__(self):
        if self.groups_per_step <= 0:
            raise ValueError(f"batcher.groups_per_step must be > 0, got {self.groups_per_step}")
        if self.stale_policy not in ("drop", "wait"):
            raise ValueError(f"batcher.stale_policy must be drop or wait, got {self.stale_policy!r}")


@dataclass
class BatcherStats:
    groups_complete: int = 0
    dropped_stale: int = 0
    dropped_filter: int = 0
    failed_rows: int = 0
    per_step: dict = field(default_factory=dict)


class WindowedBatcher:
    inputs = ("group_id", "sample_idx", "status", "reward", "token_versions")
    outputs: tuple = ()

    def __init__(self, cfg: BatcherConfig, n_samples: int, stale_steps: float = 0, strategy=None):
        self.cfg = cfg
        self.n = n_samples
        self.max_staleness = int(stale_steps)
        self.strategy = strategy        # pipeline.window strategy object; None = collect everything
        self._partial: dict[int, list[pa.Table]] = {}
        self._ready: dict[int, pa.Table] = {}  # complete groups by seq
        self.stats = BatcherStats()

    def feed(self, batch: pa.Table) -> list[int]:
        """Add streamed rows; return the seqs of groups completed by this batch."""
        done = []
        gids = batch.column("group_id").to_pylist()
        for g in sorted(set(gids)):
            part = batch.filter(pa.compute.equal(batch.column("group_id"), g))
            self._partial.setdefault(g, []).append(part)
            if sum(t.num_rows for t in self._partial[g]) >= self.n:
                self._ready[g] = pa.concat_tables(self._partial.pop(g))
                self.stats.groups_complete += 1
                done.append(g)
        return done

    def take(self, version: int, window_state=None) -> tuple[pa.Table | None, list[int]]:
        """One step's batch if B eligible groups are ready; else None. Also returns dropped seqs."""
        dropped = []
        for g in sorted(self._ready):
            t = self._ready[g]
            if self._too_stale(t, version) and self.cfg.stale_policy == "drop":
                dropped.append(g)
                self.stats.dropped_stale += 1
            elif self.cfg.filter_equal_rewards and len(set(t.column("reward").to_pylist())) <= 1:
                dropped.append(g)
                self.stats.dropped_filter += 1
        for g in dropped:
            del self._ready[g]
        eligible = [g for g in sorted(self._ready)
                    if not self._too_stale(self._ready[g], version)
                    and (self.strategy is None or window_state is None or self.strategy.can_collect(window_state, g))]
        if len(eligible) < self.cfg.groups_per_step:
            return None, dropped
        chosen = eligible[: self.cfg.groups_per_step]
        table = pa.concat_tables([self._ready.pop(g) for g in chosen])
        self.stats.failed_rows += sum(s == "failed" for s in table.column("status").to_pylist())
        return table, dropped

    def _too_stale(self, t: pa.Table, version: int) -> bool:
        """Staleness of a group = current version - oldest model token's version."""
        oldest = min((v for vs in t.column("token_versions").to_pylist() for v in vs if v >= 0), default=version)
        return version - oldest > self.max_staleness

    @property
    def buffered(self) -> int:
        return len(self._ready)
