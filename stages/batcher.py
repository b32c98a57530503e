"""Windowed batcher: streamed trajectory rows -> one training step's groups.

Input columns: group_id, sample_idx, status, reward, token_versions
Output: a pa.Table of B complete groups (N samples each), ordered by group seq. A sample
may be several rows (an agent's trajectory makes a row per segment): a group is complete
when all N of its sample indices have arrived.

Why it exists: rows arrive in whatever order the rollout workers finish; training needs
whole groups (advantages are normalised within a group), at most `stale_steps` versions
old, and in the order the window strategy allows. The bound is enforced here, on the
driver, at the last moment before training: a group older than the bound is dropped and
counted (or, with `stale_policy: wait`, never produced because the gate holds it back).
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from stages.batcher_config import BatcherConfig


@dataclass
class BatcherStats:
    groups_complete: int = 0
    dropped_stale: int = 0
    dropped_filter: int = 0
    failed_rows: int = 0
    per_step: dict = field(default_factory=dict)


LONG_QUANTILE = 0.75     # a trajectory is long when its wall time is above this quantile of all completed ones


def _trajectories(t: pa.Table) -> list[tuple[float, int, int]]:
    """(wall seconds: first dispatch to last done, model turns, response tokens) per trajectory
    (group, sample) of a group table; turns are 1 for rows without agent stats (single-turn)."""
    n = t.num_rows
    col = {c: t.column(c).to_pylist() if c in t.column_names else [None] * n
           for c in ("group_id", "sample_idx", "t_dispatch", "t_done", "agent_stats")}
    col["tokens"] = (pc.fill_null(pc.list_value_length(t.column("response_ids")), 0).to_pylist()
                     if "response_ids" in t.column_names else [0] * n)
    out: dict[tuple, list] = {}
    for g, k, lo, hi, st, n_tok in zip(*col.values()):
        cur = out.setdefault((g, k), [lo or 0.0, hi or 0.0, (st or {}).get("turns") or 1, 0])
        cur[0], cur[1], cur[3] = min(cur[0], lo or cur[0]), max(cur[1], hi or cur[1]), cur[3] + n_tok
    return [(hi - lo, turns, tokens) for lo, hi, turns, tokens in out.values()]


# wall-time bins of the fairness tally: log-spaced, 1.2% wide, 0.1 ms to ~28 h (beyond: the end bins)
_WALL_EDGES = np.geomspace(1e-4, 1e5, 1741)


class _Tally:
    """Running sums and a wall-time histogram of trajectories: constant work per summary, where a
    list of every trajectory made each step's summary re-read the whole run (a 1000-step run's
    driver spent most of its CPU there by the end, taken from the trainer on 2 cores)."""

    def __init__(self):
        self.n, self.wall, self.turns, self.tokens = 0, 0.0, 0, 0
        self.hist = np.zeros(len(_WALL_EDGES) + 1, dtype=np.int64)

    def add(self, rows: list[tuple[float, int, int]]) -> None:
        if not rows:
            return
        w, t, k = (np.asarray(c) for c in zip(*rows))
        self.n += len(rows)
        self.wall += float(w.sum())
        self.turns += int(t.sum())
        self.tokens += int(k.sum())
        np.add.at(self.hist, np.searchsorted(_WALL_EDGES, w, side="right"), 1)

    def quantile_bin(self, q: float) -> int:
        """The bin holding the trajectory of rank int(q * n) by wall time."""
        return int(np.searchsorted(np.cumsum(self.hist), min(self.n - 1, int(q * self.n)), side="right"))

    def share_above(self, b: int) -> float:
        return float(self.hist[b + 1:].sum()) / self.n


@dataclass
class Fairness:
    """What the batcher saw complete vs what it handed to the trainer, per trajectory, over the run:
    the staleness bound, the window and dynamic sampling must not bias training toward fast
    trajectories. `completed` are the trajectories of every group that arrived whole (trained,
    dropped or still buffered); `long` is a wall time above LONG_QUANTILE of the completed ones
    (to the 1.2% of the tally's wall-time bins: a trajectory in the quantile's own bin is not long)."""
    completed: _Tally = field(default_factory=_Tally)
    trained: _Tally = field(default_factory=_Tally)
    groups: dict = field(default_factory=lambda: {"completed": 0, "trained": 0, "dropped_stale": 0,
                                                  "dropped_filter": 0})

    def summary(self) -> dict:
        if not self.completed.n:
            return {}
        cut = self.completed.quantile_bin(LONG_QUANTILE)
        out = {f"fair/groups_{k}": v for k, v in self.groups.items()}
        for name, tally in (("completed", self.completed), ("trained", self.trained)):
            if tally.n:
                out[f"fair/{name}_wall_s_mean"] = tally.wall / tally.n
                out[f"fair/{name}_turns_mean"] = tally.turns / tally.n
                out[f"fair/{name}_tokens_mean"] = tally.tokens / tally.n
                out[f"fair/{name}_long_share"] = tally.share_above(cut)
        return out


class WindowedBatcher:
    inputs = ("group_id", "sample_idx", "status", "reward", "token_versions")
    outputs: tuple = ()

    def __init__(self, cfg: BatcherConfig, n_samples: int, stale_steps: float = 0, strategy=None):
        self.cfg = cfg
        self.n = n_samples
        self.max_staleness = int(stale_steps)
        self.strategy = strategy        # pipeline.window strategy object; None = collect everything
        self._partial: dict[int, list[pa.Table]] = {}
        self._samples: dict[int, set] = {}      # sample indices seen per partial group
        self._ready: dict[int, pa.Table] = {}  # complete groups by seq
        self._oldest: dict[int, float] = {}    # per ready group: its oldest trained token's version (cached)
        self.stats = BatcherStats()
        self.fairness = Fairness()

    def feed(self, batch: pa.Table) -> list[int]:
        """Add streamed rows; return the seqs of groups completed by this batch."""
        done = []
        gids = batch.column("group_id").to_numpy(zero_copy_only=False)
        if len(gids) == 0:
            return done
        # each group's rows once: one stable sort by group, then a slice per group (not a filter per group)
        order = np.argsort(gids, kind="stable")
        if (order != np.arange(len(order))).any():
            batch, gids = batch.take(order), gids[order]
        starts = np.flatnonzero(np.r_[True, gids[1:] != gids[:-1]])
        for lo, hi in zip(starts, np.r_[starts[1:], len(gids)]):
            g, part = int(gids[lo]), batch.slice(lo, hi - lo)
            self._partial.setdefault(g, []).append(part)
            seen = self._samples.setdefault(g, set())
            seen.update(part.column("sample_idx").to_pylist())
            if len(seen) >= self.n:
                self._ready[g] = pa.concat_tables(self._partial.pop(g))
                del self._samples[g]
                self.stats.groups_complete += 1
                self.fairness.groups["completed"] += 1
                done.append(g)
        if done:        # one pass over the completed groups' rows (a pass each cost ~0.2 ms per group)
            self.fairness.completed.add(_trajectories(pa.concat_tables([self._ready[g] for g in done])))
        return done

    def take(self, version: int, window_state=None) -> tuple[pa.Table | None, list[int]]:
        """One step's batch if B eligible groups are ready; else None. Also returns dropped seqs."""
        dropped = []
        for g in sorted(self._ready):
            if self._too_stale(g, version) and self.cfg.stale_policy == "mask":
                self._ready[g] = mask_stale(self._ready[g], version - self.max_staleness)
                self._oldest.pop(g, None)       # its loss mask changed: read its oldest token again
            t = self._ready[g]
            if self._too_stale(g, version) and self.cfg.stale_policy in ("drop", "mask"):
                dropped.append(g)
                self.stats.dropped_stale += 1
                self.fairness.groups["dropped_stale"] += 1
            elif self.cfg.filter_equal_rewards and len(set(t.column("reward").to_pylist())) <= 1:
                dropped.append(g)
                self.stats.dropped_filter += 1
                self.fairness.groups["dropped_filter"] += 1
        for g in dropped:
            del self._ready[g]
            self._oldest.pop(g, None)
        eligible = [g for g in sorted(self._ready)
                    if not self._too_stale(g, version)
                    and (self.strategy is None or window_state is None or self.strategy.can_collect(window_state, g))]
        if len(eligible) < self.cfg.groups_per_step:
            return None, dropped
        chosen = eligible[: self.cfg.groups_per_step]
        table = pa.concat_tables([self._ready.pop(g) for g in chosen])
        for g in chosen:
            self._oldest.pop(g, None)
        self.fairness.groups["trained"] += len(chosen)
        self.fairness.trained.add(_trajectories(table))
        self.stats.failed_rows += sum(s == "failed" for s in table.column("status").to_pylist())
        return table, dropped

    def _too_stale(self, g: int, version: int) -> bool:
        """Staleness of ready group `g` = current version - its oldest trained model token's version (a
        group with no token left in the loss is as stale as can be). The oldest version is read from
        the table once per group (and again after mask_stale), not at every collection."""
        if g not in self._oldest:
            self._oldest[g] = oldest_trained_version(self._ready[g])
        return version - self._oldest[g] > self.max_staleness

    @property
    def buffered(self) -> int:
        return len(self._ready)


def oldest_trained_version(t: pa.Table) -> float:
    """The oldest weight version among a group's model tokens in the loss; -inf if it has model tokens
    but none is left in the loss, +inf if it has no model token at all (never stale)."""
    versions = t.column("token_versions").to_pylist()
    trained = [v for vs, ks in zip(versions, _loss_masks(t)) for v, k in zip(vs, ks) if v >= 0 and k]
    if trained:
        return min(trained)
    return -math.inf if any(v >= 0 for vs in versions for v in vs) else math.inf


def _loss_masks(t: pa.Table) -> list[list[int]]:
    if "loss_mask" in t.column_names:
        return t.column("loss_mask").to_pylist()
    return [[1] * len(vs) for vs in t.column("token_versions").to_pylist()]


def mask_stale(table: pa.Table, oldest: int) -> pa.Table:
    """batcher.stale_policy=mask: tokens generated before version `oldest` leave the loss (they stay in
    the row as context the newer tokens were sampled after)."""
    from stages.schema import with_columns

    masks = [[k if v < 0 or v >= oldest else 0 for v, k in zip(vs, ks)]
             for vs, ks in zip(table.column("token_versions").to_pylist(), _loss_masks(table))]
    return with_columns(table, {"loss_mask": masks})


def mask_old_versions(table: pa.Table) -> pa.Table:
    """Partial rollout option: train only on tokens generated by a row's newest weight version."""
    from stages.schema import with_columns

    masks = []
    for vs, mask, end in zip(table.column("token_versions").to_pylist(), table.column("loss_mask").to_pylist(),
                             table.column("version_end").to_pylist()):
        masks.append([k if v == end else 0 for v, k in zip(vs, mask)])
    return with_columns(table, {"loss_mask": masks})
