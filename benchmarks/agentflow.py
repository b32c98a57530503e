"""Black-box proxy overhead per call, for each of the proxy's four endpoints: the client's round
trip minus the time the call spent on the engine.

    python benchmarks/agentflow.py [--endpoints chat completions responses messages]
                                   [--concurrency 1 8 32] [--calls 5] [--max-tokens 4] [--stream]

Workload. A real HFEngine actor (the built-in tiny model, one torch thread) serves a real
Proxy on its own event-loop thread, as on a rollout worker. The agents are aiohttp clients
in a separate process (as subprocess agents are), one coroutine per agent, each with its own
trajectory endpoint, all started at once: `--concurrency` agents in flight. Each agent makes
`--calls` sequential calls whose history grows turn by turn, the way a harness sends it (the
whole history every call, the question "37+48=" again after each answer), `--max-tokens`
tokens per completion, sampled at T=1 (5 calls: the last prompt, ~50 tokens, still fits the tiny
model's 64-token context):

    chat          POST /v1/chat/completions   messages + the assistant message returned
    completions   POST /v1/completions        prompt text + the completion text
    responses     POST /v1/responses          input items + the output items returned (store=false)
    messages      POST /v1/messages           Anthropic messages + the content blocks returned (x-api-key)

Per call: round trip at the client, engine time from the proxy's `x-loongsage-engine-ms`
header (what the engine call cost, the EngineClient's batching window included), and their
difference: the proxy's overhead (HTTP, JSON, protocol translation, chat template, prompt
assembly against the recorded segments, recording). Printed per endpoint and concurrency:
median round trip and engine time, median and p90 overhead (target: median <= 5 ms), and
the median direct EngineClient call with no proxy at the same concurrency, for scale.

`--floor` adds a row per concurrency for the same agents (chat endpoint) against a bare aiohttp
server on the same loop that reads the JSON body, calls the same EngineClient with a prompt of as
many tokens as the messages have characters (the character tokenizer's count), and answers a fixed
chat body: what HTTP, the event loop, the engine client and the agents' own process cost on this
machine with no protocol logic at all, so the proxy's own share is the difference.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing as mp
import statistics
import sys
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path[0] = str(ROOT)     # the repository first; not this folder (its transfer.py names the package)


QUESTION = "37+48="


class Chat:
    path = "/chat/completions"

    def __init__(self, max_tokens: int, stream: bool):
        self.history, self.extra = [{"role": "user", "content": QUESTION}], {"max_tokens": max_tokens, "stream": stream}

    def body(self) -> dict:
        return {"model": "m", "messages": self.history} | self.extra

    def answer(self, reply: dict) -> None:
        self.history += [reply["choices"][0]["message"], {"role": "user", "content": QUESTION}]


class Completions(Chat):
    path = "/completions"

    def __init__(self, max_tokens: int, stream: bool):
        super().__init__(max_tokens, stream)
        self.prompt = QUESTION

    def body(self) -> dict:
        return {"model": "m", "prompt": self.prompt} | self.extra

    def answer(self, reply: dict) -> None:
        self.prompt += reply["choices"][0]["text"] + QUESTION


class Responses(Chat):
    path = "/responses"

    def __init__(self, max_tokens: int, stream: bool):
        self.history = [{"type": "message", "role": "user", "content": QUESTION}]
        self.extra = {"max_output_tokens": max_tokens, "stream": stream, "store": False}

    def body(self) -> dict:
        return {"model": "m", "input": self.history} | self.extra

    def answer(self, reply: dict) -> None:
        self.history += reply["output"] + [{"type": "message", "role": "user", "content": QUESTION}]


class Messages(Chat):
    path = "/messages"

    def body(self) -> dict:
        return {"model": "m", "messages": self.history} | self.extra

    def answer(self, reply: dict) -> None:
        content = reply["content"] or [{"type": "text", "text": ""}]
        self.history += [{"role": "assistant", "content": content}, {"role": "user", "content": QUESTION}]


ENDPOINTS = {"chat": Chat, "completions": Completions, "responses": Responses, "messages": Messages}


def headers(endpoint: str, key: str) -> dict:
    if endpoint == "messages":      # the anthropic SDK's auth and version headers
        return {"x-api-key": key, "anthropic-version": "2023-06-01"}
    return {"Authorization": f"Bearer {key}"}


def final_body(endpoint: str, raw: bytes) -> dict:
    """A streamed reply's final object: the last chunk's event for responses/messages, rebuilt for chat."""
    events = [json.loads(line[6:]) for line in raw.decode().splitlines()
              if line.startswith("data: ") and line != "data: [DONE]"]
    if endpoint == "responses":
        # a reply cut at max_output_tokens ends with response.incomplete (status "incomplete"), not .completed
        return next(e["response"] for e in reversed(events)
                    if e.get("type") in ("response.completed", "response.incomplete"))
    if endpoint == "messages":
        start = next(e["message"] for e in events if e.get("type") == "message_start")
        text = "".join(e["delta"].get("text", "") for e in events if e.get("type") == "content_block_delta")
        return start | {"content": [{"type": "text", "text": text}] if text else []}
    text = "".join((c["choices"][0]["delta"].get("content") or "") if endpoint == "chat" else c["choices"][0]["text"]
                   for c in events if c.get("choices"))
    if endpoint == "chat":
        return {"choices": [{"message": {"role": "assistant", "content": text}}]}
    return {"choices": [{"text": text}]}


def agents(endpoint: str, targets: list[tuple[str, str]], calls: int, max_tokens: int, stream: bool, out) -> None:
    """Client process: one coroutine per trajectory endpoint; sends [(rtt_ms, engine_ms), ...] back."""
    import aiohttp

    async def one(session, base_url, key):
        conv, res = ENDPOINTS[endpoint](max_tokens, stream), []
        for _ in range(calls):
            t0 = time.perf_counter()
            async with session.post(base_url + conv.path, headers=headers(endpoint, key), json=conv.body()) as r:
                raw = await r.read()
                if r.status != 200:
                    raise RuntimeError(f"{endpoint}: HTTP {r.status}: {raw[:500].decode(errors='replace')}")
                engine_ms = float(r.headers["x-loongsage-engine-ms"])
            res.append(((time.perf_counter() - t0) * 1e3, engine_ms))
            conv.answer(final_body(endpoint, raw) if stream else json.loads(raw))
        return res

    async def main():
        async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as s:
            return await asyncio.gather(*(one(s, u, k) for u, k in targets))

    try:
        out.send([x for per in asyncio.run(main()) for x in per])
    except Exception as e:  # noqa: BLE001 - the parent prints what went wrong
        out.send(f"{type(e).__name__}: {e}")


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--endpoints", nargs="+", default=list(ENDPOINTS), choices=list(ENDPOINTS))
    p.add_argument("--concurrency", type=int, nargs="+", default=[1, 8, 32])
    p.add_argument("--calls", type=int, default=5)   # the 5th prompt, ~50 tokens, still fits the context (64)
    p.add_argument("--max-tokens", type=int, default=4)
    p.add_argument("--stream", action="store_true", help="streamed calls (SSE) instead of plain JSON")
    p.add_argument("--floor", action="store_true", help="also the same agents against a bare HTTP server")
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
    direct = {c: statistics.median(run(_direct(client, c, a.calls, sampling))) for c in a.concurrency}

    print(f"{'endpoint':>11} {'agents':>6} {'calls':>6} {'round trip ms':>14} {'engine ms':>10} "
          f"{'overhead ms':>12} {'p90 overhead':>13} {'direct call ms':>15}", flush=True)
    floor = Floor(client, sampling) if a.floor else None
    for endpoint in a.endpoints + (["floor"] if a.floor else []):
        for c in a.concurrency:
            server = floor if endpoint == "floor" else proxy
            eps = [run(server.open(client, dict(sampling))) for _ in range(c)]
            recv, send = ctx.Pipe(duplex=False)
            proc = ctx.Process(target=agents, args=("chat" if endpoint == "floor" else endpoint,
                                                    [(e.base_url, e.api_key) for e in eps], a.calls,
                                                    a.max_tokens, a.stream, send))
            proc.start()
            res = recv.recv()
            proc.join()
            for e in eps:
                server.close(e)
            if isinstance(res, str):
                print(f"{endpoint:>11} {c:>6}  failed: {res}", flush=True)
                continue
            over = sorted(r - e for r, e in res)
            print(f"{endpoint:>11} {c:>6} {len(res):>6} {statistics.median(r for r, _ in res):>14.2f} "
                  f"{statistics.median(e for _, e in res):>10.2f} {statistics.median(over):>12.2f} "
                  f"{over[int(0.9 * (len(over) - 1))]:>13.2f} {direct[c]:>15.2f}", flush=True)
    run(proxy.stop())
    if floor is not None:
        run(floor.stop())
    ray.shutdown()


class Floor:
    """A bare HTTP server in the proxy's place (--floor): the chat endpoint's HTTP and engine call, nothing else."""

    def __init__(self, client, sampling: dict):
        self.client, self.sampling, self.runner, self.port = client, sampling, None, 0

    async def open(self, client, sampling: dict):
        from types import SimpleNamespace

        from aiohttp import web
        if self.runner is None:
            app = web.Application()
            app.router.add_post("/t/{route}/v1/chat/completions", self._chat)
            self.runner = web.AppRunner(app, access_log=None, handle_signals=False)
            await self.runner.setup()
            await web.TCPSite(self.runner, "127.0.0.1", 0, backlog=1024).start()
            self.port = self.runner.addresses[0][1]
        return SimpleNamespace(base_url=f"http://127.0.0.1:{self.port}/t/floor/v1", api_key="floor")

    def close(self, ep) -> None:
        pass

    async def stop(self) -> None:
        if self.runner is not None:
            await self.runner.cleanup()

    async def _chat(self, request):
        from aiohttp import web
        body = json.loads(await request.read())
        n = sum(len(m.get("content") or "") + (m["role"] == "assistant") for m in body["messages"])
        ids = [PROMPT_IDS[i % len(PROMPT_IDS)] for i in range(max(1, n))]
        t0 = time.perf_counter()
        row = {**self.sampling, "prompt_ids": ids, "max_new_tokens": body["max_tokens"]}
        (out,) = await self.client.generate([row])
        ms = (time.perf_counter() - t0) * 1e3
        text, headers = "5" * len(out["response_ids"]), {"x-loongsage-engine-ms": f"{ms:.3f}"}
        if body.get("stream"):      # --stream: one chunk and [DONE], as the proxy writes a stream in one go
            chunk = {"choices": [{"index": 0, "delta": {"content": text}, "finish_reason": "length"}]}
            data = f"data: {json.dumps(chunk)}\n\ndata: [DONE]\n\n".encode()
            return web.Response(body=data, content_type="text/event-stream", headers=headers)
        message = {"role": "assistant", "content": text}
        reply = {"choices": [{"index": 0, "finish_reason": "length", "message": message}]}
        return web.json_response(reply, headers=headers)


PROMPT_IDS = [6, 10, 13, 7, 11, 14]     # "37+48=" in the built-in tokenizer


async def _direct(client, concurrency: int, calls: int, sampling: dict) -> list[float]:
    """The same number of calls straight through the engine client (a white-box agent's path)."""
    async def one():
        out = []
        for _ in range(calls):
            t0 = time.perf_counter()
            await client.generate([{**sampling, "prompt_ids": PROMPT_IDS}])
            out.append((time.perf_counter() - t0) * 1e3)
        return out

    return [x for per in await asyncio.gather(*(one() for _ in range(concurrency))) for x in per]


if __name__ == "__main__":
    main()
