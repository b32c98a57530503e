"""The proxy as a rollout worker runs it, for tests that call it synchronously like any agent program."""
from __future__ import annotations

import asyncio
import threading

import ray

from stages.agentflow.client import EngineClient

GREEDY = {"max_new_tokens": 6, "temperature": 0.0, "top_p": 1.0}


class RecordingClient(EngineClient):
    """The real client; also keeps every (requests, results) pair the engine answered, so the proxy's
    records can be compared with the engine's own output token for token."""

    def __init__(self, engine):
        super().__init__(engine)
        self.calls: list[tuple[list[dict], list[dict]]] = []

    async def generate(self, requests):
        out = await super().generate(requests)
        self.calls.append((requests, out))
        return out


class LoopThread:
    """An event loop on a thread of its own (the proxy's loop, as on a rollout worker)."""

    def __init__(self):
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()

    def run(self, coro):
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout=60)

    def stop(self):
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(5)


@ray.remote(num_cpus=0)
class CrashingEngine:
    """A fault injected behind the proxy: an engine whose generate raises (a real Ray task error)."""

    def generate(self, requests):
        raise RuntimeError("boom: secret engine internals")
