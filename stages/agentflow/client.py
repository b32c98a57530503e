"""Client side of the engines: the many trajectories of a rollout worker call one engine concurrently; calls within
a few milliseconds go as one batch (a call per token stream would waste the engine's batch), each caller getting
its own result."""
from __future__ import annotations

import asyncio

from ray.exceptions import ActorUnavailableError, RayActorError


class EngineRestarting(RuntimeError):
    """Raised by an engine Ray restarted that has not been re-sent the current weights yet (it reaches
    the caller wrapped in a RayTaskError that is also an instance of this class)."""


# the engine process died or is restarting: a trajectory is re-run, a proxy caller gets 503 (Anthropic: 529)
ENGINE_LOST = (RayActorError, ActorUnavailableError, EngineRestarting)
WINDOW_S = 0.002    # calls this close together go to the engine as one batch


class EngineClient:
    def __init__(self, engine):
        self.engine = engine
        self._pending: list[tuple[dict, asyncio.Future]] = []
        self._flusher: asyncio.Task | None = None
        self._sending: set[asyncio.Task] = set()
        self.lost = 0       # engine calls failed by its death: a trajectory that saw this change is re-run (rollout.py)

    async def generate(self, requests: list[dict]) -> list[dict]:
        futs = [asyncio.get_running_loop().create_future() for _ in requests]
        self._pending += zip(requests, futs)
        if self._flusher is None or self._flusher.done():
            self._flusher = asyncio.ensure_future(self._flush())
        return list(await asyncio.gather(*futs))

    async def _flush(self) -> None:
        # The batch goes to a task of its own, so this flusher is done before the engine answers: a request
        # arriving meanwhile (an agent's next turn) schedules a new flush instead of waiting behind this one.
        await asyncio.sleep(WINDOW_S)
        batch, self._pending = self._pending, []
        task = asyncio.ensure_future(self._send(batch))
        self._sending.add(task)                      # strong reference: the loop keeps only weak ones
        task.add_done_callback(self._sending.discard)

    async def _send(self, batch) -> None:
        try:
            results = await self.engine.generate.remote([r for r, _ in batch])
        except Exception as e:  # noqa: BLE001 - every waiting trajectory gets the engine's error
            if isinstance(e, ENGINE_LOST):
                self.lost += 1
            for _, f in batch:
                if not f.done():
                    f.set_exception(e)
            return
        for (_, f), res in zip(batch, results):
            if not f.done():
                f.set_result(res)


class Affinity:
    """Session affinity: every call of one trajectory (and one group) goes to the same engine."""

    def __init__(self, engines: list):
        if not engines:
            raise ValueError("rollout needs at least one engine")
        self.clients = [EngineClient(e) for e in engines]

    def for_group(self, group_id: int) -> EngineClient:
        return self.clients[group_id % len(self.clients)]
