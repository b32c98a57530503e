"""Black-box proxy overhead per call: proxy round trip minus the time the call spent on the engine.

    python benchmarks/agentflow.py [--concurrency 1 8 32] [--calls 8] [--max-tokens 4]

A real HFEngine actor (the built-in tiny model) serves a real Proxy on its own event-loop
thread, as on a rollout worker. The agents are aiohttp clients in a separate process (as
subprocess agents are), each with its own endpoint, making `--calls` sequential chat calls
whose history grows turn by turn. Per call: round trip at the client, engine time from the
proxy's `x-loongsage-engine-ms` header (what a direct EngineClient call of the same request
costs, batching window included), and their difference: the proxy's overhead (HTTP, JSON,
chat template, prompt assembly, recording). Also printed: the median direct call with no
proxy, at the same concurrency, for scale.
"""
from __future__ import annotations

import argparse
import asyncio
import multiprocessing as mp
import statistics
import sys
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path[0] = str(ROOT)     # the repository first; not this folder (its transfer.py names the package)


def agents(endpoints: list[tuple[str, str]], calls: int, max_tokens: int, out) -> None:
    """Client process: one coroutine per endpoint; sends [(rtt_ms, engine_ms), ...] back."""
    import aiohttp

    async def one(session, base_url, key):
        messages, res = [{"role": "user", "content": "37+48="}], []
        for _ in range(calls):
            t0 = time.perf_counter()
            async with session.post(f"{base_url}/chat/completions", headers={"Authorization": f"Bearer {key}"},
                                    json={"model": "m", "messages": messages, "max_tokens": max_tokens}) as r:
                body = await r.json()
                engine_ms = float(r.headers["x-loongsage-engine-ms"])
            res.append(((time.perf_counter() - t0) * 1e3, engine_ms))
            messages += [body["choices"][0]["message"], {"role": "user", "content": "37+48="}]
        return res

    async def main():
        async with aiohttp.ClientSession() as s:
            return await asyncio.gather(*(one(s, u, k) for u, k in endpoints))

    out.send([x for per in asyncio.run(main()) for x in per])


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--concurrency", type=int, nargs="+", default=[1, 8, 32])
    p.add_argument("--calls", type=int, default=8)
    p.add_argument("--max-tokens", type=int, default=4)
    a = p.parse_args()

    import ray

    from pipeline.cluster import init_ray
    from pipeline.config import load_config
    from stages.agentflow.client import EngineClient
    from stages.agentflow.engine import HFEngine
    from stages.agentflow.proxy import Proxy
    from stages.model import ModelConfig, load_tokenizer, resolve_model_path

    path = resolve_model_path(ModelConfig())
    init_ray(load_config(None, ["run.ray_num_cpus=2"]), 2)   # workers import the project from ROOT
    engine = ray.remote(HFEngine).options(max_concurrency=16).remote(path, num_threads=1)
    ray.get(engine.info.remote())
    loop = asyncio.new_event_loop()
    threading.Thread(target=loop.run_forever, daemon=True).start()
    run = lambda coro: asyncio.run_coroutine_threadsafe(coro, loop).result()  # noqa: E731
    proxy = Proxy(load_tokenizer(path))
    sampling = {"max_new_tokens": a.max_tokens, "temperature": 1.0, "top_p": 1.0}
    client = EngineClient(engine)
    ctx = mp.get_context("spawn")

    print(f"{'agents':>6} {'calls':>6} {'round trip ms':>14} {'engine ms':>10} {'overhead ms':>12} "
          f"{'p90 overhead':>13} {'direct call ms':>15}")
    for c in a.concurrency:
        eps = [run(proxy.open(client, dict(sampling))) for _ in range(c)]
        recv, send = ctx.Pipe(duplex=False)
        proc = ctx.Process(target=agents, args=([(e.base_url, e.api_key) for e in eps], a.calls, a.max_tokens, send))
        proc.start()
        res = recv.recv()
        proc.join()
        for e in eps:
            proxy.close(e)
        over = sorted(r - e for r, e in res)
        direct = run(_direct(client, c, a.calls, sampling))
        print(f"{c:>6} {len(res):>6} {statistics.median(r for r, _ in res):>14.2f} "
              f"{statistics.median(e for _, e in res):>10.2f} {statistics.median(over):>12.2f} "
              f"{over[int(0.9 * (len(over) - 1))]:>13.2f} {statistics.median(direct):>15.2f}")
    run(proxy.stop())
    ray.shutdown()


async def _direct(client, concurrency: int, calls: int, sampling: dict) -> list[float]:
    """The same number of calls straight through the engine client (a white-box agent's path)."""
    async def one():
        out = []
        for _ in range(calls):
            t0 = time.perf_counter()
            await client.generate([{**sampling, "prompt_ids": [6, 10, 13, 7, 11, 14]}])
            out.append((time.perf_counter() - t0) * 1e3)
        return out

    return [x for per in await asyncio.gather(*(one() for _ in range(concurrency))) for x in per]


if __name__ == "__main__":
    main()
