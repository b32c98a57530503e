"""Black-box agents cannot see each other (stages/agentflow/blackbox.py, jail.py): real agent processes, real proxy.

Four trajectories' agents run at once through AgentFlowRollout. Each one hunts for the others' proxy
keys in every /proc/N/environ and cmdline it can read. Jailed (rollout.agent_sandbox auto, where
bwrap runs), spawned or forked from the zygote, none finds any. Unjailed, the same agent finds
them -- the test can fail -- and a key used on another trajectory's endpoint is refused (401).
"""
from __future__ import annotations

import json
import os
import sys
import textwrap

import pytest
import ray

from stages.agentflow import jail
from stages.agentflow.engine import HFEngine
from stages.agentflow.rollout import AgentFlowRollout, RolloutConfig
from stages.schema import table_from_columns

JAILS = not jail.probe()
HUNT = textwrap.dedent('''
    import json, os, re, time, urllib.error, urllib.request
    own, url = os.environ["OPENAI_API_KEY"], os.environ["OPENAI_BASE_URL"]

    def call(base, key):
        req = urllib.request.Request(base + "/completions", data=json.dumps({"prompt": "1+1="}).encode(),
                                     headers={"Authorization": "Bearer " + key, "Content-Type": "application/json"})
        try:
            urllib.request.urlopen(req, timeout=120).read()
            return 200
        except urllib.error.HTTPError as e:
            return e.code

    first = call(url, own)
    time.sleep(2.0)             # the other trajectories' agents are alive by now
    found = {}
    for d in os.listdir("/proc"):
        if not d.isdigit():
            continue
        for name in ("environ", "cmdline"):
            try:
                data = open(f"/proc/{d}/{name}", "rb").read().decode(errors="replace")
            except OSError:
                continue
            for k in set(re.findall(r"sk-loongsage-[A-Za-z0-9_-]+", data)) - {own}:
                m = re.search(r"OPENAI_BASE_URL=([^\\x00]+)", data)
                found[k] = m.group(1) if m else ""
    cross = [call(u, own) for u in found.values() if u]   # our key on their endpoint
    home = os.environ.get("HOME", "")
    try:
        user_home = os.listdir(os.path.expanduser("~root"))
    except OSError as e:
        user_home = str(e)
    print(json.dumps({"reward": 0.0, "info": {"first": first, "found": len(found), "cross": cross,
                                             "home": sorted(os.listdir(home)) if os.path.isdir(home) else None,
                                             "user_home": user_home}}))
''')


@pytest.fixture(scope="module")
def engine(ray_session, tiny_model_dir):
    eng = ray.remote(HFEngine).options(num_cpus=0.1, max_concurrency=16).remote(tiny_model_dir)
    ray.get(eng.info.remote())
    yield eng
    ray.kill(eng)


def _hunt(engine, tiny_model_dir, tmp_path, **cfg) -> list[dict]:
    agent = tmp_path / "hunt.py"
    agent.write_text(HUNT)
    n = 4
    stage = AgentFlowRollout(RolloutConfig(agent=f"cmd:python {agent}", max_new_tokens=2, temperature=0.0,
                                           timeout_s=240, **cfg), [engine], None, tiny_model_dir)
    try:
        out = stage(table_from_columns({"prompt_id": [f"p{i}" for i in range(n)], "group_id": list(range(n)),
                                        "sample_idx": [0] * n, "data_source": ["addition"] * n,
                                        "prompt": ["1+1="] * n, "answer": ["2"] * n}))
    finally:
        stage.close()
    rows = out.to_pylist()
    assert all(r["status"] in ("completed", "truncated") for r in rows), [r["error"] for r in rows]
    return [json.loads(r["agent_info"]) for r in rows]


@pytest.mark.skipif(not JAILS, reason=f"no bubblewrap jail here: {jail.probe()}")
@pytest.mark.parametrize("preload", [(), ("json", "re", "urllib.request")], ids=["spawned", "forked"])
def test_a_jailed_agent_that_hunts_for_other_keys_finds_none(engine, tiny_model_dir, tmp_path, preload):
    template = tmp_path / "home-template"
    template.mkdir()
    (template / "config.json").write_text("{}")
    cfg = {"agent_preload": preload} if preload else {"agent_home": str(template)}
    infos = _hunt(engine, tiny_model_dir, tmp_path, **cfg)
    assert all(i["first"] == 200 for i in infos), infos
    assert [i["found"] for i in infos] == [0] * 4, infos
    # the user's home (credentials) is hidden: only the way to the interpreter, if it lives there, is bound back
    home = os.path.expanduser("~root")
    allowed = {os.path.relpath(p, home).split(os.sep)[0] for p in (sys.prefix, sys.base_prefix,
                                                                   os.path.realpath(sys.executable))
               if p.startswith(home.rstrip("/") + "/")}
    assert all(isinstance(i["user_home"], list) and set(i["user_home"]) <= allowed for i in infos), infos
    if not preload:                                              # a fresh HOME, the template copied in
        assert all(i["home"] == ["config.json"] for i in infos), infos


@pytest.mark.skipif(os.geteuid() != 0, reason="unjailed agents of another user cannot read root's /proc either")
def test_unjailed_agents_find_keys_but_a_key_works_on_its_own_endpoint_only(engine, tiny_model_dir, tmp_path):
    infos = _hunt(engine, tiny_model_dir, tmp_path, agent_sandbox="none")
    assert sum(i["found"] for i in infos) > 0, infos            # what the jail is for
    cross = [c for i in infos for c in i["cross"]]
    # refused: 401 on a live endpoint, 404 once that trajectory has ended and its endpoint is gone
    assert cross and all(c in (401, 404) for c in cross) and 401 in cross, infos


def test_strict_agent_sandbox_refuses_a_preload_and_bad_settings_name_the_key(tmp_path):
    from stages.agentflow.rollout import load_agent

    cfg = RolloutConfig(agent="cmd:python examples/agents/addition.py", agent_preload=("json",),
                        agent_sandbox="strict")
    agent = load_agent(cfg.agent, cfg.agent_preload)
    with pytest.raises(ValueError, match="agent_sandbox=strict"):
        agent.configure(cfg)
    for kw, key in [({"agent_sandbox": "maybe"}, "rollout.agent_sandbox"),
                    ({"agent_home": str(tmp_path / "none")}, "rollout.agent_home"),
                    ({"agent_binds": ("relative/path",)}, "rollout.agent_binds")]:
        with pytest.raises(ValueError, match=key):
            RolloutConfig(**kw)
