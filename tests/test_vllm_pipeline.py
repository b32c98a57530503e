"""The quickstart recipe with engine.kind=vllm: the rollout stage and the controller drive a vLLM
engine actor exactly as they drive the embedded one (a few steps on the tiny built-in model)."""
from __future__ import annotations

import pyarrow.parquet as pq
import pytest

pytestmark = pytest.mark.vllm
pytest.importorskip("vllm", reason="vLLM is not installed (pip install -e '.[vllm]')")

import ray  # noqa: E402

from pipeline.config import load_config  # noqa: E402
from pipeline.controller import Controller  # noqa: E402
from pipeline.metrics import read_metrics  # noqa: E402
from tests.support.runs import FAST  # noqa: E402


def test_quickstart_steps_on_the_vllm_engine(ray_session, tiny_model_dir, tmp_path):
    cfg = load_config("configs/quickstart.yaml", FAST + [f"model.path={tiny_model_dir}", "engine.kind=vllm",
                                                         "engine.count=1", "vllm.kv_cache_mb=64"])
    ctl = Controller(cfg, tmp_path / "run", log=lambda *_: None)
    try:
        summary = ctl.run()
        assert summary["steps"] == 3 and summary["version"] == 3
        assert [i["engine"] for i in ray.get([e.info.remote() for e in ctl.engines])] == ["vllm"]
        assert ray.get(ctl.engines[0].weight_version.remote()) == 3
    finally:
        ctl.stop()
    lines = read_metrics(tmp_path / "run")
    steps = [m for m in lines if "train/loss" in m]
    assert [m["transfer/version"] for m in steps] == [1, 2, 3] and steps[-1]["engine/running_rows_max"] >= 1
    # the engine's log-probs are the trainer's: the decoupled update measures the gap on fresh tokens
    assert all(m["mismatch/k3_kl/fresh"] <= 1e-4 for m in steps if "mismatch/k3_kl/fresh" in m)
    evals = [m for m in lines if "eval/accuracy" in m]
    assert [m["step"] for m in evals] == [0, 2, 3]
    for k in (1, 2, 3):
        rows = pq.read_table(tmp_path / "run" / "rollouts" / f"step={k:06d}").to_pylist()
        assert len(rows) == 16 and all(set(r["token_versions"]) == {k - 1} for r in rows)
        assert all(len(r["response_logprobs"]) == len(r["response_ids"]) for r in rows)
