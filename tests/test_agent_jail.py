"""Black-box agent jails (stages/agentflow/sandbox/jail.py, blackbox.py, zygote.py): real bwrap jails, real agent
processes, the real proxy, through AgentFlowRollout.

Each test is one way a trajectory's agent could reach what is not its own: another trajectory's key, result or
processes (through the /proc it sees, a daemon outliving it, the zygote's channel), the user's secrets, the
task's answer, the host's files and sockets, more than its share of the machine. Every test runs each agent
spawned (a jail per trajectory) and forked (agent.preload: the zygote), and every one of them would
fail unjailed (`test_unjailed_agents_find_keys_...` shows the hunt finds keys there).
"""
from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import textwrap
import time

import pytest
import ray

from stages.agentflow.config import AgentConfig, SamplingConfig
from stages.agentflow.engine import HFEngine
from stages.agentflow.rollout import AgentFlowRollout
from stages.agentflow.sandbox import jail
from stages.schema import table_from_columns

JAILS = not jail.probe()
needs_jail = pytest.mark.skipif(not JAILS, reason=f"no bubblewrap jail here: {jail.probe()}")
needs_cgroups = pytest.mark.skipif(bool(jail.Cgroup.available()), reason=f"no cgroups: {jail.Cgroup.available()}")
# forked: the zygote preloads a module of the standard library and one of the environment's packages (yaml)
MODES = pytest.mark.parametrize("preload", [(), ("json", "urllib.request", "yaml")], ids=["spawned", "forked"])
CALL = textwrap.dedent('''
    import json, os, urllib.error, urllib.request

    def call(base=None, key=None):
        base, key = base or os.environ["OPENAI_BASE_URL"], key or os.environ["OPENAI_API_KEY"]
        req = urllib.request.Request(base + "/completions", data=json.dumps({"prompt": "1+1="}).encode(),
                                     headers={"Authorization": "Bearer " + key, "Content-Type": "application/json"})
        try:
            urllib.request.urlopen(req, timeout=120).read()
            return 200
        except urllib.error.HTTPError as e:
            return e.code
''')


@pytest.fixture(scope="module")
def engine(ray_session, tiny_model_dir):
    eng = ray.remote(HFEngine).options(num_cpus=0.1, max_concurrency=16).remote(tiny_model_dir)
    ray.get(eng.info.remote())
    yield eng
    ray.kill(eng)


def _run(engine, tiny_model_dir, tmp_path, body: str, n: int = 4, **cfg) -> list[dict]:
    """n trajectories of the agent `body` (CALL prepended); their rows, each with its report parsed."""
    agent = tmp_path / "agent.py"
    agent.write_text(CALL + textwrap.dedent(body))
    stage = AgentFlowRollout([engine], None, tiny_model_dir, sampling=SamplingConfig(max_new_tokens=2, temperature=0.0),
                             agent=AgentConfig(**({"name": f"cmd:python {agent}", "timeout_s": 240} | cfg)))
    try:
        out = stage(table_from_columns({"prompt_id": [f"p{i}" for i in range(n)], "group_id": list(range(n)),
                                        "sample_idx": [0] * n, "data_source": ["addition"] * n,
                                        "prompt": [f"{i}+1=" for i in range(n)],
                                        "answer": [f"ans{i}w" for i in range(n)]}))
    finally:
        stage.close()
    return [r | {"report": json.loads(r["agent_info"] or "{}")} for r in out.to_pylist()]


def _ok(rows: list[dict]) -> list[dict]:
    assert all(r["status"] in ("completed", "truncated") for r in rows), [r["error"] for r in rows]
    return [r["report"] for r in rows]


HUNT = '''
    import re, time
    own = os.environ["OPENAI_API_KEY"]
    first = call()
    time.sleep(2.0)             # the other trajectories' agents are alive by now
    found = {}
    for d in os.listdir("/proc"):
        if d.isdigit():
            for name in ("environ", "cmdline"):
                try:
                    data = open(f"/proc/{d}/{name}", "rb").read().decode(errors="replace")
                except OSError:
                    continue
                for k in set(re.findall(r"sk-loongsage-[A-Za-z0-9_-]+", data)) - {own}:
                    m = re.search(r"OPENAI_BASE_URL=([^\\x00]+)", data)
                    found[k] = m.group(1) if m else ""
    cross = [call(u) for u in found.values() if u]    # our key on their endpoint
    print(json.dumps({"first": first, "found": len(found), "cross": cross, "procs": len(os.listdir("/proc"))}))
'''


@needs_jail
@MODES
def test_a_jailed_agent_that_hunts_for_other_keys_finds_none(engine, tiny_model_dir, tmp_path, preload):
    reports = _ok(_run(engine, tiny_model_dir, tmp_path, HUNT, preload=preload))
    assert all(r["first"] == 200 for r in reports), reports
    assert [r["found"] for r in reports] == [0] * 4, reports


@pytest.mark.skipif(os.geteuid() != 0, reason="unjailed agents of another user cannot read root's /proc either")
def test_unjailed_agents_find_keys_but_a_key_works_on_its_own_endpoint_only(engine, tiny_model_dir, tmp_path):
    reports = _ok(_run(engine, tiny_model_dir, tmp_path, HUNT, jail="none"))
    assert sum(r["found"] for r in reports) > 0, reports            # what the jail is for
    cross = [c for r in reports for c in r["cross"]]
    # refused: 401 on a live endpoint, 404 once that trajectory has ended and its endpoint is gone
    assert cross and all(c in (401, 404) for c in cross) and 401 in cross, reports


@needs_jail
@MODES
def test_a_trajectory_cannot_outlive_itself_or_reach_the_next_ones(engine, tiny_model_dir, tmp_path, preload):
    """The forgery of issue 47: the first trajectory double-forks a setsid daemon that plants what it can
    (files in /tmp and HOME, an abstract socket, the proxy's port, any socket file of the zygote's it can find)
    and waits for the next trajectories. Trajectories run one at a time: the daemon is gone when its trajectory
    ends, and each later trajectory finds nothing planted and reports what it did itself."""
    marker = f"daemon-{os.getpid()}-{len(preload)}"
    body = f'''
    import socket, subprocess, sys
    prompt = json.loads(os.environ["LOONGSAGE_SAMPLE"])["prompt"]
    port = int(os.environ["OPENAI_BASE_URL"].split(":")[2].split("/")[0])
    if prompt == "0+1=":
        daemon = """
    import os, socket, sys, time
    os.setsid()
    if os.fork():
        os._exit(0)
    for d in ("/tmp", os.environ["HOME"]):
        open(os.path.join(d, "planted"), "w").write("forged")
    a = socket.socket(socket.AF_UNIX); a.bind("\\\\0loongsage-planted"); a.listen()
    sockets = [p for top in ("/tmp", "/run", "/var", "/loongsage") for r, _, fs in os.walk(top)
               for p in (os.path.join(r, f) for f in fs) if os.path.exists(p) and not os.path.isfile(p)]
    for p in sockets:
        os.rename(p, p + ".old")
    time.sleep(120)
    """
        subprocess.Popen([sys.executable, "-c", daemon, {marker!r}])
        time.sleep(1)
    planted = [p for p in ("/tmp/planted", os.path.join(os.environ["HOME"], "planted")) if os.path.exists(p)]
    a = socket.socket(socket.AF_UNIX)
    try:
        a.connect("\\0loongsage-planted")
        planted.append("abstract")
    except OSError:
        pass
    print(json.dumps({{"prompt": prompt, "call": call(), "planted": planted, "answers": [prompt]}}))
    '''
    rows = _run(engine, tiny_model_dir, tmp_path, "import time\n" + textwrap.dedent(body), max_agents=1,
                preload=preload)
    reports = _ok(rows)
    assert [r["prompt"] for r in reports] == [r["prompt"] for r in rows]       # each result its own process's
    assert reports[0]["planted"] == ["/tmp/planted", "/tmp/home/planted", "abstract"], reports[0]   # it did plant
    assert all(r["call"] == 200 and r["planted"] == [] for r in reports[1:]), reports
    assert not _alive_with(marker)


def _alive_with(marker: str, grace_s: float = 5.0) -> list[int]:
    """Host pids whose command line holds `marker`, still running after `grace_s`."""
    deadline = time.time() + grace_s
    while True:
        alive = []
        for d in filter(str.isdigit, os.listdir("/proc")):
            try:
                with open(f"/proc/{d}/cmdline", "rb") as f:
                    if marker.encode() not in f.read():
                        continue
                with open(f"/proc/{d}/stat") as f:
                    if f.read().rsplit(")", 1)[1].split()[0] not in ("Z", "X"):
                        alive.append(int(d))
            except OSError:
                pass
        if not alive or time.time() > deadline:
            return alive
        time.sleep(0.1)


@needs_jail
@MODES
def test_agents_get_no_secrets_and_no_answer(engine, tiny_model_dir, tmp_path, preload, monkeypatch):
    monkeypatch.setenv("HF_TOKEN", "hf_secret_of_the_user")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "aws_secret_of_the_user")
    monkeypatch.setenv("LOONGSAGE_TEST_PASSED", "passed-through")
    body = '''
    everything = b""
    for d in filter(str.isdigit, os.listdir("/proc")):
        for name in ("environ", "cmdline"):
            try:
                everything += open(f"/proc/{d}/{name}", "rb").read()
            except OSError:
                pass
    sample = json.loads(os.environ["LOONGSAGE_SAMPLE"])
    status = dict(line.split(":", 1) for line in open("/proc/self/status").read().splitlines() if ":" in line)
    print(json.dumps({"caps": status["CapEff"].strip(), "nnp": status["NoNewPrivs"].strip(),
                      "seccomp": status["Seccomp"].strip(), "env": sorted(os.environ),
                      "passed": os.environ.get("LOONGSAGE_TEST_PASSED"),
                      "secrets": [s for s in ("hf_secret", "aws_secret", "ans0w", "ans1w", "ans2w", "ans3w")
                                  if s.encode() in everything],
                      "sample": sorted(sample), "call": call()}))
    '''
    reports = _ok(_run(engine, tiny_model_dir, tmp_path, body, preload=preload,
                       env=("LOONGSAGE_TEST_PASSED",)))
    allowed = {"PATH", "LANG", "LANGUAGE", "TERM", "TZ", "HOME", "TMPDIR", "PWD", "OPENAI_BASE_URL", "OPENAI_API_KEY",
               "ANTHROPIC_BASE_URL", "ANTHROPIC_API_KEY", "LOONGSAGE_SAMPLE", "LOONGSAGE_SEED", "LOONGSAGE_TEST_PASSED"}
    for r in reports:
        assert set(r["env"]) - allowed <= {k for k in r["env"] if k.startswith("LC_")}, r["env"]
        assert r["passed"] == "passed-through" and r["secrets"] == [] and r["call"] == 200, r
        assert "answer" not in r["sample"] and "prompt" in r["sample"]
        assert (r["caps"], r["nnp"], r["seccomp"]) == ("0000000000000000", "1", "2" if jail.seccomp_bpf() else "0")


@needs_jail
@MODES
def test_host_sockets_files_and_ports_are_out_of_reach(engine, tiny_model_dir, tmp_path, preload):
    secrets_dir = tmp_path.parent / f"host-{tmp_path.name}"       # beside the agent's directory, not in it
    secrets_dir.mkdir()
    secret = secrets_dir / "secret.txt"
    secret.write_text("the host's secret")
    secret.chmod(0o600)
    unix = socket.socket(socket.AF_UNIX)
    unix.bind(str(secrets_dir / "host.sock"))
    unix.listen()
    abstract = socket.socket(socket.AF_UNIX)
    abstract.bind(f"\0loongsage-host-{os.getpid()}")
    abstract.listen()
    tcp = socket.socket()
    tcp.bind(("127.0.0.1", 0))
    tcp.listen()
    port = tcp.getsockname()[1]
    home = os.path.expanduser("~")
    body = f'''
    import socket
    out = {{"call": call(), "reached": [], "read": []}}
    for fam, addr in ((socket.AF_UNIX, {str(secrets_dir / "host.sock")!r}),
                      (socket.AF_UNIX, "\\0loongsage-host-{os.getpid()}"), (socket.AF_INET, ("127.0.0.1", {port}))):
        s = socket.socket(fam)
        s.settimeout(2)
        try:
            s.connect(addr)
            out["reached"].append(str(addr))
        except OSError:
            pass
    for p in ({str(secret)!r}, "/etc/shadow", {home!r}, "/var", "/run", {os.getcwd()!r}):
        try:
            out["read"].append([p, open(p).read()[:20] if os.path.isfile(p) else os.listdir(p)])
        except OSError:
            pass
    net = open("/proc/net/unix").read() + open("/proc/net/tcp").read()
    out["listed"] = [s for s in ("loongsage-host-{os.getpid()}", ":{port:04X}") if s in net]
    print(json.dumps(out))
    '''
    try:
        reports = _ok(_run(engine, tiny_model_dir, tmp_path, body, preload=preload))
    finally:
        for s in (unix, abstract, tcp):
            s.close()
    bound = jail.agent_paths([sys.executable, str(tmp_path / "agent.py")], ())
    for r in reports:
        assert r["call"] == 200 and r["reached"] == [] and r["listed"] == [], r
        # no file of the host's is readable; a directory holds only the way to what the jail binds (the interpreter)
        for p, listing in r["read"]:
            assert isinstance(listing, list), (p, listing)
            assert set(listing) <= {os.path.relpath(b, p).split(os.sep)[0] for b in bound if b.startswith(p + "/")}


@needs_jail
@needs_cgroups
@MODES
def test_processes_memory_and_tmp_are_bounded(engine, tiny_model_dir, tmp_path, preload):
    body = '''
    import time
    kind = json.loads(os.environ["LOONGSAGE_SAMPLE"])["prompt"]
    call()
    out = {"kind": kind}
    if kind == "0+1=":          # a fork bomb: 300 children that sleep
        n = 0
        try:
            for _ in range(300):
                if os.fork() == 0:
                    time.sleep(30)
                    os._exit(0)
                n += 1
        except OSError as e:
            out["error"] = e.errno
        out["forked"] = n
    elif kind == "1+1=":        # 1 GiB into /tmp
        try:
            with open("/tmp/fill", "wb") as f:
                for _ in range(1024):
                    f.write(b"x" * (1 << 20))
        except OSError as e:
            out["error"] = e.errno
        out["written_mb"] = os.path.getsize("/tmp/fill") >> 20
    elif kind == "2+1=":        # 3 GiB touched
        blocks = [bytearray(64 << 20) for _ in range(48)]
        out["touched_mb"] = 64 * len(blocks)
    print(json.dumps(out))
    '''
    rows = _run(engine, tiny_model_dir, tmp_path, body, n=3, preload=preload, procs=64,
                tmp_mb=64, memory_mb=512)
    fork, tmp, mem = rows
    assert fork["status"] == "completed" and fork["report"]["forked"] < 64 and fork["report"]["error"] == 11, fork
    assert tmp["status"] == "completed" and tmp["report"]["written_mb"] <= 64 and tmp["report"]["error"] == 28, tmp
    assert mem["status"] == "failed" and "killed by signal 9 at its memory limit" in mem["error"], mem["error"]


@needs_jail
def test_agents_at_once_are_bounded(engine, tiny_model_dir, tmp_path):
    body = '''
    import time
    t0 = time.time()
    call()
    time.sleep(0.5)
    print(json.dumps({"t0": t0, "t1": time.time()}))
    '''
    from stages.agentflow.rollout import load_agent

    agent = load_agent("cmd:python examples/agents/addition.py")
    agent.configure(AgentConfig())
    assert agent.limit == 16            # agent.max_agents: 0, the default, bounds cmd: agents too
    reports = _ok(_run(engine, tiny_model_dir, tmp_path, body, n=12, max_agents=3))
    events = sorted([(r["t0"], 1) for r in reports] + [(r["t1"], -1) for r in reports])
    alive = peak = 0
    for _, d in events:
        alive += d
        peak = max(peak, alive)
    assert peak <= 3, peak


def test_without_a_working_jail_a_blackbox_run_is_refused_at_start(tmp_path):
    """No bwrap on PATH: `loongsage run` refuses in one line naming the key and the package, before Ray."""
    env = os.environ | {"PATH": str(tmp_path)}       # an empty directory: no bwrap (nor anything else)
    p = subprocess.run([sys.executable, "-m", "pipeline.cli", "run", "configs/agent_blackbox.yaml", "--run-dir",
                        str(tmp_path / "run")], capture_output=True, text=True, env=env, timeout=120)
    lines = [ln for ln in p.stderr.splitlines() if ln.strip()]
    assert p.returncode != 0 and "Traceback" not in p.stderr, p.stderr[-2000:]
    assert len(lines) == 1 and "agent.jail" in lines[0] and "apt-get install bubblewrap" in lines[0], lines
    assert not (tmp_path / "run" / "ray.log").exists()      # refused before Ray started


def test_bad_agent_settings_name_the_key(tmp_path):
    from pipeline.config import ConfigError, load_config

    for override, key in [("agent.jail=maybe", "agent.jail"),
                          (f"agent.home={tmp_path / 'none'}", "agent.home"),
                          ("agent.env=[NOT A NAME]", "agent.env"),
                          ("agent.memory_mb=0", "agent.memory_mb")]:
        with pytest.raises((ConfigError, ValueError), match=key):
            load_config(None, [override])


def test_a_jails_connection_serves_its_own_route_only(tiny_model_dir):
    """What the jail's forwarder gets (Proxy.attach) is bound to its trajectory: another trajectory's route and
    key, sent over it, are refused as unknown (404), while the same request on the proxy's TCP port is not."""
    import asyncio

    from stages.agentflow.proxy import Proxy
    from stages.model import load_tokenizer

    async def go():
        proxy = Proxy(load_tokenizer(tiny_model_dir))
        mine, theirs = await proxy.open(None, {}), await proxy.open(None, {})

        async def get(sock_or_port, ep) -> int:
            if isinstance(sock_or_port, int):
                r, w = await asyncio.open_connection("127.0.0.1", sock_or_port)
            else:
                r, w = await asyncio.open_connection(sock=sock_or_port)
            w.write(f"GET /t/{ep.route}/v1/models HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {ep.api_key}\r\n"
                    f"Connection: close\r\n\r\n".encode())
            status = int((await r.readline()).split()[1])
            w.close()
            return status

        try:
            codes = (await get(await mine.connect(), mine), await get(await mine.connect(), theirs),
                     await get(proxy.port, theirs))
        finally:
            await proxy.stop()
        return codes

    assert asyncio.run(go()) == (200, 404, 200)
