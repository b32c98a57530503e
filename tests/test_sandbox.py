"""The code sandbox (stages/agentflow/sandbox/pool.py): real worker processes, real limits, one sandbox per trajectory.

Each bad snippet -- a loop that never ends, a 10 GB allocation, a fork bomb, a write outside
its directory, a stdout flood -- must come back as an error observation within its limit, the
worker must be replaced by a fresh process, the next call must work, and no process may be
left behind (counted over this test's descendants and the sandbox uids). The isolation this
machine allows (network, PID and mount namespaces, own uid) is checked where the probe says
it holds; the trajectory-level test runs the `sandbox` agent on a real engine. The attacker-and-victim
property: whatever one trajectory's code does (poison builtins and modules, plant files, read other
processes' environment, leave processes), no other trajectory's result changes and nothing it writes
is visible to another.
"""
from __future__ import annotations

import asyncio
import os
import subprocess
import sys
import time

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from stages.agentflow.config import AgentConfig, SamplingConfig
from stages.agentflow.rollout import AgentFlowRollout
from stages.agentflow.sandbox.pool import UID_BASE, UID_SLOTS, SandboxConfig, SandboxPool, probe_isolation
from stages.agentflow.tools import ToolRegistry
from stages.tasks.agents import SandboxAgent

ISO = probe_isolation()
FAST = dict(workers=1, cpu_s=1.0, timeout_s=1.5, memory_mb=256, output_bytes=2048)


def _procs() -> dict[int, tuple[int, int]]:
    """pid -> (ppid, uid) of every process on the machine."""
    out = {}
    for d in os.listdir("/proc"):
        if d.isdigit():
            try:
                with open(f"/proc/{d}/status") as f:
                    st = dict(line.split(":", 1) for line in f if ":" in line)
                out[int(d)] = (int(st["PPid"]), int(st["Uid"].split()[0]))
            except (OSError, KeyError, ValueError):
                pass
    return out


def sandbox_processes() -> list[int]:
    """Our descendant sandbox processes (unshare, workers), and any process running under a sandbox uid
    (a snippet's child, wherever it went)."""
    procs, me = _procs(), os.getpid()
    mine = {me}
    changed = True
    while changed:
        changed = False
        for pid, (ppid, _) in procs.items():
            if ppid in mine and pid not in mine:
                mine.add(pid)
                changed = True
    mine.discard(me)
    mine = {p for p in mine if _is_sandbox(p)}      # not Ray's workers, which come and go on their own
    return sorted(mine | {p for p, (_, uid) in procs.items() if UID_BASE <= uid < UID_BASE + 4096 * UID_SLOTS})


def _is_sandbox(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            argv = f.read().split(b"\0")
    except OSError:
        return False
    return argv[0].endswith((b"unshare", b"bwrap")) or any(a.endswith((b"sandbox_worker.py", b"worker.py"))
                                                           for a in argv)


def describe(pids) -> list[str]:
    out = []
    for p in pids:
        try:
            with open(f"/proc/{p}/cmdline") as f:
                out.append(f"{p}: {f.read().replace(chr(0), ' ')[:120]}")
        except OSError:
            out.append(f"{p}: gone")
    return out


def run(coro):
    return asyncio.run(coro)


async def _settle(pool: SandboxPool) -> None:
    """Wait for replacements started in the background."""
    for _ in range(200):
        if not pool._spawning:
            return
        await asyncio.sleep(0.05)


BAD = {
    "loop": ("while True:\n    pass", ("timeout", "cpu")),
    "sleep": ("import time\ntime.sleep(60)", ("timeout",)),
    "memory_10gb": ("x = bytearray(10 * 2**30)", ("memory",)),
    "fork_bomb": ("import os\nwhile True:\n    os.fork()", ("fork",)),
    "write_outside": ("open('/etc/loongsage-sandbox-test', 'w').write('x')", ("filesystem",)),
    "file_too_big": ("open('big', 'wb').write(b'x' * (20 << 20))", ("filesystem", "memory")),   # file_mb 16
    "tmp_full": ("for i in range(5):\n    open(f'f{i}', 'wb').write(b'x' * (10 << 20))", ("filesystem", "memory")),
    "stdout_flood": ("import sys\nwhile True:\n    sys.stdout.write('A' * 4096)", ("output",)),
    "raw_fd_flood": ("import os\nwhile True:\n    os.write(1, b'B' * 4096)", ("output",)),
}


@pytest.mark.parametrize("name", list(BAD))
def test_bad_snippet_is_killed_replaced_and_leaves_nothing(name):
    code, kinds = BAD[name]
    before = sandbox_processes()

    async def go():
        pool = SandboxPool(SandboxConfig(**FAST))
        try:
            async with pool.session() as s:
                assert (await s.run("6*7")).output.strip() == "42"
                first = s.worker.pid
                res = await s.run(code)
                await _settle(pool)
                after = await s.run("6*7")       # the session still serves, from a fresh worker
                return res, first, s.worker.pid, after, dict(pool.stats)
        finally:
            await pool.close()

    res, first, second, after, stats = run(go())
    assert res.kind in kinds, res
    assert res.text().startswith(f"error: sandbox {res.kind} limit"), res.text()
    assert res.replaced and stats["replaced"] == 1 and stats[res.kind] == 1
    assert first != second, "the breaching worker must be replaced by a new process"
    assert after.ok and after.output.strip() == "42"
    limit = FAST["timeout_s"] + 1.0 if res.kind in ("timeout", "cpu") else 1.0
    assert res.wall_s < limit, f"{name}: {res.kind} took {res.wall_s:.2f}s"
    assert len(res.output) <= FAST["output_bytes"]
    assert not os.path.exists("/etc/loongsage-sandbox-test")
    time.sleep(0.2)
    left = sandbox_processes()
    assert left == before, f"a sandbox process outlived its pool: {describe(left)} (before: {describe(before)})"


def test_cpu_limit_stops_a_busy_snippet_before_the_wall_clock():
    async def go():
        pool = SandboxPool(SandboxConfig(workers=1, cpu_s=1.0, timeout_s=60))
        try:
            return await pool.run("while True:\n    pass")
        finally:
            await pool.close()

    res = run(go())
    assert res.kind == "cpu" and res.replaced, res
    assert res.wall_s < 30      # 1-2 CPU seconds; the wall time only stretches when the machine is busy


def test_snippet_results_and_ordinary_errors_keep_the_worker():
    async def go():
        pool = SandboxPool(SandboxConfig(**FAST))
        try:
            async with pool.session() as s:
                a = await s.run("37*48*29")
                pid = s.worker.pid
                b = await s.run("print('partial')\n1/0")
                c = await s.run("x = 3\nprint(x + 1)")
                d = await s.run("x")                      # fresh globals per call
                e = await s.run("def f(:\n")
                return a, b, c, d, e, pid, s.worker.pid
        finally:
            await pool.close()

    a, b, c, d, e, pid, pid_after = run(go())
    assert a.ok and a.output == "51504\n"
    assert b.kind == "error" and "ZeroDivisionError" in b.error and b.output == "partial\n"
    assert b.text().startswith("error: ZeroDivisionError") and not b.replaced
    assert c.output == "4\n"
    assert d.kind == "error" and "NameError" in d.error
    assert e.kind == "error" and "SyntaxError" in e.error
    assert pid == pid_after, "an ordinary exception must not cost a worker"


def test_tool_registry_timeout_kills_the_worker_too():
    """The registry's own timeout cancels the call: the worker it was using is killed, not reused."""
    before = sandbox_processes()

    async def go():
        pool = SandboxPool(SandboxConfig(workers=1, timeout_s=30))
        reg = ToolRegistry([pool.tool()], timeout_s=3.0)
        try:
            pool._spares.append(await pool._spawn())  # a started spare: the timeout lands in the snippet
            t0 = time.perf_counter()
            res = await reg.call("python", {"code": "import time\ntime.sleep(30)"})
            dt = time.perf_counter() - t0
            await _settle(pool)
            return res, dt, await reg.call("python", {"code": "1+1"}), pool.stats["replaced"]
        finally:
            await pool.close()

    res, dt, after, replaced = run(go())
    assert res.startswith("error: tool python timed out") and dt < 6
    assert after == "2\n" and replaced == 1
    time.sleep(0.2)
    assert sandbox_processes() == before


def test_concurrent_calls_each_get_a_sandbox_of_their_own():
    async def go():
        pool = SandboxPool(SandboxConfig(workers=2, timeout_s=5))
        try:
            return await asyncio.gather(*(pool.run(f"{i}*{i}") for i in range(12)))
        finally:
            await pool.close()

    assert [r.output.strip() for r in run(go())] == [str(i * i) for i in range(12)]


def test_a_session_ends_its_worker_and_the_next_session_gets_another():
    async def go():
        pool = SandboxPool(SandboxConfig(**FAST))
        try:
            async with pool.session() as a:
                await a.run("1")
                first = a.worker.proc.pid
            gone = first not in [w.proc.pid for w in pool._all.values()]
            async with pool.session() as b:
                await b.run("1")
                return gone, first, b.worker.proc.pid
        finally:
            await pool.close()

    gone, first, second = run(go())
    assert gone and first != second


def test_a_prestarted_session_serves_and_one_closed_at_once_leaves_nothing():
    before = sandbox_processes()

    async def go():
        pool = SandboxPool(SandboxConfig(**FAST))
        try:
            early = pool.session()
            early.prestart()
            await early.close()                 # closed while its sandbox may still be starting
            async with pool.session() as s:
                s.prestart()
                return (await s.run("6*7")).output
        finally:
            await pool.close()

    assert run(go()) == "42\n"
    time.sleep(0.2)
    assert sandbox_processes() == before


@pytest.mark.skipif(not ISO.network, reason=f"no network namespace here: {ISO.describe()}")
def test_no_network():
    async def go():
        pool = SandboxPool(SandboxConfig(**FAST))
        try:
            return await pool.run("import socket\nsocket.create_connection(('1.1.1.1', 53), timeout=1)")
        finally:
            await pool.close()

    res = run(go())
    assert res.kind == "error" and "unreachable" in res.error.lower(), res


@pytest.mark.skipif(not (ISO.pid and ISO.private_tmp and ISO.uid), reason=f"not isolated here: {ISO.describe()}")
def test_private_tmp_own_pid_namespace_and_uid():
    marker = f"/tmp/loongsage-host-{os.getpid()}"
    open(marker, "w").close()
    try:
        async def go():
            pool = SandboxPool(SandboxConfig(**FAST))
            try:
                async with pool.session() as s:
                    a = await s.run(f"import os\n(os.path.exists({marker!r}), os.getpid(), os.getuid(), os.getcwd())")
                    b = await s.run("open('left.txt', 'w').write('x')\nimport os\nos.listdir('.')")
                    c = await s.run("import os\nos.listdir('.')")     # emptied between calls
                    return a, b, c
            finally:
                await pool.close()

        a, b, c = run(go())
    finally:
        os.unlink(marker)
    exists, pid, uid, cwd = eval(a.output)
    assert not exists and pid == 1 and uid >= UID_BASE and cwd == "/tmp"
    assert b.output.strip() == "['left.txt']" and c.output.strip() == "[]"


# ---- one trajectory's code cannot reach another's ------------------------------------------------
ATTACK = [
    # poison what the next caller would use: builtins, a stdlib module, the worker's own json and print
    "import builtins, json, math, sys\nbuiltins.abs = lambda x: 666\nbuiltins.int = lambda *a: 666\n"
    "math.sqrt = lambda x: 666\nsys.modules['json'].dumps = lambda *a, **k: '666'\n"
    "builtins.print = lambda *a, **k: None",
    # plant answers wherever another trajectory might look
    "import os\nfor d in ('.', '/tmp', '/dev/shm', '/var/tmp', '/sandbox', '/usr', '/'):\n"
    "    try:\n        open(os.path.join(d, 'answer.txt'), 'w').write('666')\n    except OSError:\n        pass",
    # look for other processes and their environment (keys), and the host's
    "import os\nseen = []\nfor p in [f'/proc/{d}/environ' for d in os.listdir('/proc') if d.isdigit()]:\n"
    "    try:\n        seen.append((p, len(open(p, 'rb').read())))\n    except OSError:\n        pass\n"
    "sorted(int(d) for d in os.listdir('/proc') if d.isdigit()), seen",
    # leave a process behind that plants files later
    "import os, time\nif os.fork() == 0:\n    time.sleep(1.0)\n"
    "    for d in ('/tmp', '/dev/shm'):\n        open(d + '/answer.txt', 'w').write('666')\n    os._exit(0)",
]


def victim(k: int) -> list[tuple[str, str]]:
    """(snippet, the output it must give) for trajectory k: arithmetic through builtins and the stdlib, a
    file of its own, and a look for anything another trajectory left."""
    look = "import os\n[sorted(os.listdir(d)) for d in ('.', '/tmp', '/dev/shm')]"
    return [(f"import math, json\nabs(-{k}) + int(math.sqrt({k * k})), json.dumps([{k}])", f"({2 * k}, '[{k}]')\n"),
            (look, "[[], [], []]\n"),
            (f"open('answer.txt', 'w').write('{k}')\nopen('answer.txt').read()", f"'{k}'\n"),
            (look, "[[], [], []]\n")]


async def _trajectory(pool: SandboxPool, calls: list[str], pause: float = 0.0) -> list[str]:
    async with pool.session() as s:
        out = []
        for code in calls:
            out.append((await s.run(code)).output)
            await asyncio.sleep(pause)
        return out


@settings(max_examples=4, deadline=None, suppress_health_check=list(HealthCheck))
@given(attacker=st.integers(0, 3), together=st.booleans())
def test_no_trajectory_changes_another_ones_result(attacker, together):
    """N trajectories, one attacker: whatever its code does, before or while the others run, no victim's result
    changes and nothing it wrote is visible to them."""
    n = 4
    before = sandbox_processes()

    async def go():
        pool = SandboxPool(SandboxConfig(**{**FAST, "workers": 2}))
        try:
            victims = {k: [c for c, _ in victim(k)] for k in range(n) if k != attacker}
            if together:        # the victims' calls interleave with the attacker's (its forked child outlives it)
                runs = [_trajectory(pool, ATTACK, pause=0.3)] + [_trajectory(pool, v, 0.3) for v in victims.values()]
                outs = await asyncio.gather(*runs)
                seen = outs[0][2]
                got = dict(zip(victims, outs[1:]))
            else:               # the attacker ran first (the contamination a persistent worker let through)
                seen = (await _trajectory(pool, ATTACK))[2]
                await asyncio.sleep(1.2)
                got = {k: await _trajectory(pool, v) for k, v in victims.items()}
            return seen, got
        finally:
            await pool.close()

    seen, got = run(go())
    for k, outs in got.items():
        assert outs == [o for _, o in victim(k)], f"trajectory {k}'s results changed: {outs}"
    if ISO.pid:         # its own PID namespace: the only process it sees is itself, the only environ its own
        pids, environs = eval(seen)
        assert pids == [1] and all(p == "/proc/1/environ" for p, _ in environs), seen
    time.sleep(0.2)
    assert sandbox_processes() == before


@pytest.mark.skipif(not ISO.unix_sockets, reason=f"host Unix sockets reachable here: {ISO.describe()}")
def test_host_unix_sockets_are_out_of_reach(tmp_path):
    """A Unix socket the run's user can reach -- a file in /tmp, one elsewhere, an abstract one -- is not
    reachable from the sandbox: none is accepted a connection."""
    import socket

    paths = [str(tmp_path / "host.sock"), f"/run/loongsage-test-{os.getpid()}.sock"]
    abstract = f"\0loongsage-test-{os.getpid()}"
    servers = []
    for addr in [*paths, abstract]:
        srv = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        srv.bind(addr)
        os.chmod(addr, 0o777) if not addr.startswith("\0") else None
        srv.listen(4)
        srv.setblocking(False)
        servers.append(srv)
    probe = "import socket\nres = []\nfor a in {addrs!r}:\n    s = socket.socket(socket.AF_UNIX)\n    try:\n" \
            "        s.connect(a)\n        res.append('connected')\n    except OSError as e:\n" \
            "        res.append(type(e).__name__)\nres"

    async def go():
        pool = SandboxPool(SandboxConfig(**FAST))
        try:
            return await pool.run(probe.format(addrs=[*paths, abstract]))
        finally:
            await pool.close()

    try:
        res = run(go())
        accepted = 0
        for srv in servers:
            try:
                srv.accept()
                accepted += 1
            except BlockingIOError:
                pass
    finally:
        for srv in servers:
            srv.close()
        os.unlink(paths[1])
    assert res.ok and "connected" not in res.output, res
    assert accepted == 0


@pytest.mark.skipif(not (ISO.seccomp and ISO.no_new_privs), reason=f"no seccomp here: {ISO.describe()}")
def test_seccomp_filter_and_no_new_privs_hold():
    code = ("import ctypes, os, socket\nlibc = ctypes.CDLL(None, use_errno=True)\n"
            "st = dict(l.split(':', 1) for l in open('/proc/self/status'))\n"
            "def denied(rc):\n    return rc == -1 and ctypes.get_errno() in (1, 38)\n"
            "out = {'nnp': st['NoNewPrivs'].strip(), 'seccomp': st['Seccomp'].strip(),\n"
            "       'unshare': denied(libc.unshare(0x10000000)), 'ptrace': denied(libc.ptrace(16, 1, 0, 0)),\n"
            "       'mount': denied(libc.mount(b'none', b'/tmp', b'tmpfs', 0, None))}\n"
            "try:\n    socket.socket(socket.AF_NETLINK, socket.SOCK_RAW)\n    out['netlink'] = False\n"
            "except PermissionError:\n    out['netlink'] = True\nout")

    async def go():
        pool = SandboxPool(SandboxConfig(**FAST))
        try:
            return await pool.run(code)
        finally:
            await pool.close()

    res = run(go())
    assert res.ok, res
    assert eval(res.output) == {"nnp": "1", "seccomp": "2", "unshare": True, "ptrace": True, "mount": True,
                                "netlink": True}


def test_bad_config_names_the_key():
    for kw, key in [({"workers": 0}, "sandbox.workers"), ({"timeout_s": 0}, "sandbox.timeout_s"),
                    ({"isolation": "maybe"}, "sandbox.isolation"), ({"nproc": -1}, "sandbox.nproc")]:
        with pytest.raises(ValueError, match=key):
            SandboxConfig(**kw)


def test_without_a_working_jail_a_sandbox_run_is_refused_at_start(tmp_path):
    """No bwrap on PATH: `loongsage run` of the sandbox recipe refuses in one line naming the key, before Ray."""
    env = os.environ | {"PATH": str(tmp_path)}       # an empty directory: no bwrap
    p = subprocess.run([sys.executable, "-m", "pipeline.cli", "run", "configs/agent_sandbox.yaml", "--run-dir",
                        str(tmp_path / "run")], capture_output=True, text=True, env=env, timeout=120)
    lines = [ln for ln in p.stderr.splitlines() if ln.strip()]
    assert p.returncode != 0 and "Traceback" not in p.stderr, p.stderr[-2000:]
    assert len(lines) == 1 and "sandbox.isolation" in lines[0] and "apt-get install bubblewrap" in lines[0]


class BreachThenAnswer(SandboxAgent):
    """The `sandbox` agent's own tool path, with snippets the test picks: each bad one, then a good one,
    then a model turn -- the trajectory must go on past every breach."""
    async def run(self, ctx, sample):
        session = self.attach(ctx)
        try:
            for code, _ in BAD.values():
                await self.run_snippet(ctx, code)
            await self.run_snippet(ctx, "2+3")
            await ctx.generate()
        finally:
            await session.close()


@pytest.mark.slow      # an engine actor on Ray: 25-45 s on 2 busy cores
def test_trajectory_goes_on_past_every_breach(ray_session, tiny_model_dir):
    import json

    import ray

    from stages.agentflow.engine import HFEngine
    from stages.schema import table_from_columns

    before = sandbox_processes()
    engine = ray.remote(HFEngine).options(num_cpus=0.1, max_concurrency=4).remote(tiny_model_dir)
    agent, sandbox = AgentConfig(name="sandbox", max_turns=4), SandboxConfig(**FAST)
    stage = AgentFlowRollout([engine], None, tiny_model_dir, sampling=SamplingConfig(max_new_tokens=4, temperature=0.0),
                             agent=agent, sandbox=sandbox)
    stage.agent = BreachThenAnswer()
    stage.agent.configure(agent, sandbox)
    try:
        out = stage(table_from_columns({"prompt_id": ["p0"], "group_id": [0], "sample_idx": [0],
                                        "data_source": ["addition"], "prompt": ["12+34="], "answer": ["46"]}))
        stats = dict(stage.agent.pool.stats)
    finally:
        stage.close()
        ray.kill(engine)
    row = out.to_pylist()[0]
    assert row["status"] == "completed", row["error"]
    errors = json.loads(row["agent_info"])["tool_errors"]
    assert len(errors) == len(BAD) and all(e.startswith("error: sandbox ") for e in errors), errors
    tools = [t["content"] for t in json.loads(row["transcript"]) if t["role"] == "tool"]
    assert tools[-1] == "5=" and all(t in ("?=", "=") for t in tools[:-1]), tools   # a failure reads "?="
    assert row["agent_stats"]["tool_calls"] == len(BAD) + 1 and row["agent_stats"]["turns"] == 1
    assert stats["replaced"] == len(BAD)
    time.sleep(0.2)
    assert sandbox_processes() == before
