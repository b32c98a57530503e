"""The remote tool service (stages/agentflow/sandbox/tool_service.py): a real HTTP server process.

Its service times follow the configured lognormal (seeded), its waiting costs wall time and
not CPU, and every way it can fail -- down, 500, too slow, unknown key -- reaches the agent as
an error observation (on_error=observe) or a ToolFatalError that fails the trajectory
(on_error=fail), never a hang.
"""
from __future__ import annotations

import asyncio
import socket
import statistics
import time
from pathlib import Path

import pytest

from stages.agentflow.sandbox.tool_service import (
    ToolService,
    ToolServiceClient,
    ToolServiceConfig,
    ToolServiceError,
    lognormal,
)
from stages.agentflow.tools import ToolFatalError, ToolRegistry


@pytest.fixture(scope="module")
def service():
    svc = ToolService(ToolServiceConfig(p50_s=0.05, p99_s=0.5, seed=7))
    svc.start()
    yield svc
    svc.stop()


def _cpu_s(pid: int) -> float:
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / 100.0     # utime + stime, in clock ticks (100 Hz)


def test_lognormal_matches_its_percentiles():
    d = lognormal(0.2, 1.5, seed=0)
    xs = sorted(d() for _ in range(20000))
    assert xs[len(xs) // 2] == pytest.approx(0.2, rel=0.05)
    assert xs[int(len(xs) * 0.99)] == pytest.approx(1.5, rel=0.1)
    a, b = lognormal(0.2, 1.5, 3), lognormal(0.2, 1.5, 3)
    assert [a() for _ in range(5)] == [b() for _ in range(5)]


def test_lookups_wait_in_wall_time_not_cpu(service):
    async def go():
        client = ToolServiceClient(service.url, ToolServiceConfig(timeout_s=10))
        try:
            t0 = time.perf_counter()
            cpu0 = _cpu_s(service.proc.pid)
            out = await asyncio.gather(*(client.lookup(str(k)) for k in range(200)))
            return out, time.perf_counter() - t0, _cpu_s(service.proc.pid) - cpu0
        finally:
            await client.close()

    out, wall, cpu = asyncio.run(go())
    waits = sorted(o["latency_s"] for o in out)
    assert out[37]["value"] == {"square": 1369, "cube": 50653, "digit_sum": 10, "prime": True}
    assert statistics.median(waits) == pytest.approx(0.05, rel=0.35)
    assert waits[-1] > 5 * statistics.median(waits)           # a real tail
    assert wall < sum(waits) / 5, "concurrent waits overlap: the service does not compute while it waits"
    assert cpu < sum(waits) / 2, f"the service burned {cpu:.2f}s CPU for {sum(waits):.2f}s of waiting"


def _free_port() -> int:
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()
    return port


def test_service_down_is_an_observation_or_a_fatal_error():
    url = f"http://127.0.0.1:{_free_port()}"     # nothing listens there

    async def go(on_error):
        client = ToolServiceClient(url, ToolServiceConfig(timeout_s=2, on_error=on_error))
        try:
            return await ToolRegistry([client.tool()]).call("lookup", {"key": "12"})
        finally:
            await client.close()

    t0 = time.perf_counter()
    text = asyncio.run(go("observe"))
    assert text.startswith("error: tool service") and "unreachable" in text and time.perf_counter() - t0 < 3
    with pytest.raises(ToolFatalError, match="unreachable"):
        asyncio.run(go("fail"))


def test_500_timeout_and_unknown_key():
    flaky = ToolService(ToolServiceConfig(p50_s=0.01, p99_s=0.02, error_rate=1.0))
    slow = ToolService(ToolServiceConfig(p50_s=3.0, p99_s=3.0))
    try:
        flaky.start()
        slow.start()

        async def go():
            out = []
            for url, key, timeout in ((flaky.url, "1", 5), (slow.url, "1", 0.3), (slow.url, "x", 5)):
                client = ToolServiceClient(url, ToolServiceConfig(timeout_s=timeout))
                t0 = time.perf_counter()
                try:
                    await client.lookup(key)
                    out.append(("ok", time.perf_counter() - t0, client.stats["errors"]))
                except ToolServiceError as e:
                    out.append((str(e), time.perf_counter() - t0, client.stats["errors"]))
                finally:
                    await client.close()
            return out

        (e500, _, n500), (etimeout, dt, _), (e404, _, _) = asyncio.run(go())
    finally:
        flaky.stop()
        slow.stop()
    assert "answered 500" in e500 and n500 == 1
    assert "timed out after 0.3s" in etimeout and dt < 1.5
    assert "answered 404" in e404 and "no entry for key 'x'" in e404


def test_bad_config_names_the_key():
    for kw, key in [({"p50_s": 0}, "p50_s"), ({"p50_s": 2, "p99_s": 1}, "p99_s"), ({"error_rate": 2}, "error_rate"),
                    ({"timeout_s": 0}, "timeout_s"), ({"on_error": "ignore"}, "on_error")]:
        with pytest.raises(ValueError, match=f"tool_service.{key}"):
            ToolServiceConfig(**kw)


def _children(pid: int) -> list[int]:
    import subprocess

    out = subprocess.run(["pgrep", "-P", str(pid)], capture_output=True, text=True).stdout.split()
    return [int(x) for x in out]


def test_remote_sandbox_runs_snippets_after_its_service_time_and_stops_clean():
    """POST /run: a hosted sandbox as an agent sees one -- the service's latency, then the snippet in
    a SandboxPool of the service's own, limits enforced there; stopping the service ends its workers."""
    from stages.agentflow.sandbox.pool import SandboxConfig

    svc = ToolService(ToolServiceConfig(p50_s=0.05, p99_s=0.2, seed=3),
                      sandbox=SandboxConfig(workers=1, timeout_s=1.0, cpu_s=1.0))
    svc.start()

    async def go():
        client = ToolServiceClient(svc.url, ToolServiceConfig(timeout_s=10), key=svc.key)
        try:
            ok = await asyncio.gather(*(client.run(f"{k}*48*29") for k in (37, 12, 99)))
            tool = client.sandbox_tool()
            looped = await tool.fn(code="while True: pass")
            again = await tool.fn(code="6*7")
            return ok, looped, again
        finally:
            await client.close()

    try:
        ok, looped, again = asyncio.run(go())
        assert [o["text"].strip() for o in ok] == [str(37 * 48 * 29), str(12 * 48 * 29), str(99 * 48 * 29)]
        assert all(o["kind"] == "ok" and o["latency_s"] > 0 for o in ok)
        assert looped.startswith("error: sandbox") and ("timeout" in looped or "cpu" in looped), looped
        assert again.strip() == "42"            # the breached worker was replaced
        workers = _children(svc.proc.pid)
        assert workers, "the sandbox's worker runs under the service process"
    finally:
        svc.stop()
    time.sleep(0.5)
    assert not [p for p in workers if _alive(p)], "stopping the service ended its sandbox workers"


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def test_run_needs_the_services_key_and_sessions_keep_trajectories_apart():
    """/run and /close answer 401 without the service's key (any local process can reach loopback); a session
    is one trajectory's sandbox: its state stays in it, another session sees none of it, /close ends it."""
    from stages.agentflow.sandbox.pool import SandboxConfig

    svc = ToolService(ToolServiceConfig(p50_s=0.01, p99_s=0.02, seed=3), sandbox=SandboxConfig(workers=1))
    svc.start()
    assert svc.key and svc.key not in " ".join(Path(f"/proc/{svc.proc.pid}/cmdline").read_text().split("\0"))

    async def go():
        cfg = ToolServiceConfig(timeout_s=10)
        anon, wrong, client = (ToolServiceClient(svc.url, cfg, key=""), ToolServiceClient(svc.url, cfg, key="x"),
                               ToolServiceClient(svc.url, cfg, key=svc.key))
        try:
            refused = []
            for c in (anon, wrong):
                for call in (c.run("6*7"), c._post("s", path="/close", field="session")):
                    try:
                        await call
                        refused.append(False)
                    except ToolServiceError as e:
                        refused.append("401" in str(e))
            a, b = client.session(), client.session()
            ta, tb = a.tool(), b.tool()
            planted = await ta.fn(code="import builtins, os\nbuiltins.abs = lambda x: 'pwn'\n"
                                       "open('/dev/shm/planted', 'w').write('x')\nos.listdir('/dev/shm')")
            same = await ta.fn(code="import os\n(abs(-1), os.listdir('/dev/shm'))")
            other = await tb.fn(code="import os\n(abs(-1), os.listdir('/dev/shm'))")
            await a.close()
            closed = await client._post(a.id, path="/close", field="session")
            await b.close()
            return refused, planted, same, other, closed
        finally:
            for c in (anon, wrong, client):
                await c.close()

    try:
        refused, planted, same, other, closed = asyncio.run(go())
    finally:
        svc.stop()
    assert refused == [True] * 4
    assert planted.strip() == "['planted']"
    assert same.strip() == "('pwn', ['planted'])"         # its own trajectory keeps what it did
    assert other.strip() == "(1, [])"                    # another trajectory sees none of it
    assert closed == {"closed": False}                   # already closed by a.close()


def test_service_with_a_sandbox_refuses_to_start_without_a_key():
    import os
    import subprocess
    import sys

    env = {k: v for k, v in os.environ.items() if k != "LOONGSAGE_TOOL_SERVICE_KEY"}
    r = subprocess.run([sys.executable, "-m", "stages.agentflow.sandbox.tool_service", "--sandbox-json", "{}"],
                       capture_output=True, text=True, timeout=60, env=env)
    assert r.returncode != 0 and "LOONGSAGE_TOOL_SERVICE_KEY" in r.stderr, r.stderr
