"""SGLang rollout engine (stages/agentflow/sglang_engine.py).

On CPU: what the engine reports to the TransferMesh matches the HF engine, SGLang's
per-token version spans and finish reasons map onto the engine contract, and the engine
refuses to start without a GPU. The server itself runs only where CUDA and sglang are
(`gpu` marker): generate -> weight update -> generate, as benchmarks/gpu/sglang_check.py.
"""
from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

from stages.agentflow.engine import HFEngine
from stages.agentflow.engine_contract import published_specs
from stages.agentflow.sglang_engine import SGLangConfig, SGLangEngine, parse_output, versions_of
from stages.model import ModelConfig, resolve_model_path

OWN_RAY = True      # a Ray of its own: it starts without the shared Ray

HAVE_GPU = torch.cuda.is_available()


@pytest.fixture(scope="module")
def model_path(tmp_path_factory) -> str:
    # hidden 256 over 4 heads: head_dim 64, which SGLang's attention kernels support
    cfg = ModelConfig(hidden_size=256, num_layers=2, warmup_steps=1, cache_dir=str(tmp_path_factory.mktemp("m")))
    return resolve_model_path(cfg, log=lambda *_: None)


def test_weight_specs_are_the_hf_engines(model_path):
    """The mesh checks a receiver's specs name by name: an SGLang engine must expect what
    an HF engine of the same model expects (lm_head listed even though it is tied)."""
    assert published_specs(model_path, "float32") == HFEngine(model_path).weight_specs()
    assert {d for _, d in published_specs(model_path, "bfloat16").values()} == {torch.bfloat16}


def test_version_spans_expand_to_one_version_per_token():
    meta = {"weight_version": "2", "weight_versions": [{"version": "1", "start": 0, "end": 3},
                                                       {"version": "2", "start": 3, "end": 5}]}
    assert versions_of(meta, 5) == [1, 1, 1, 2, 2]
    assert versions_of({"weight_version": "7"}, 3) == [7, 7, 7]


def test_a_resumed_partial_rollout_keeps_its_prefix_and_maps_finish_reasons():
    prefix = {"prefix_ids": [5, 6], "prefix_logprobs": [-0.1, -0.2], "prefix_versions": [3, 3]}
    out = {"output_ids": [7, 1], "meta_info": {
        "output_token_logprobs": [[-0.5, 7, None], [-0.01, 1, None]], "finish_reason": {"type": "stop"},
        "weight_version": "4", "weight_versions": [{"version": "4", "start": 0, "end": 2}]}}
    got = parse_output(out, prefix)
    assert got == {"response_ids": [5, 6, 7, 1], "logprobs": [-0.1, -0.2, -0.5, -0.01],
                   "versions": [3, 3, 4, 4], "status": "completed"}
    for reason, status in [("length", "truncated"), ("abort", "aborted")]:
        out["meta_info"]["finish_reason"] = {"type": reason}
        assert parse_output(out, {})["status"] == status


@pytest.mark.skipif(HAVE_GPU, reason="checks the CPU-only refusal")
def test_without_a_gpu_the_engine_refuses_to_start(model_path):
    with pytest.raises(RuntimeError, match="needs a CUDA GPU"):
        SGLangEngine(model_path)


def test_bad_settings_are_rejected():
    with pytest.raises(ValueError, match="sglang.pause_mode must be"):
        SGLangConfig(pause_mode="drop")
    with pytest.raises(ValueError, match="sglang.mem_fraction"):
        SGLangConfig(mem_fraction=1.5)


@pytest.mark.gpu
@pytest.mark.skipif(not HAVE_GPU, reason="SGLang needs a CUDA GPU")
def test_generate_update_generate_on_a_gpu(model_path):
    pytest.importorskip("sglang.srt.utils", reason="sglang is not installed (pip install sglang)")
    import ray

    from stages.model import load_model

    ray.init(address="local", include_dashboard=False, log_to_driver=False,
             runtime_env={"env_vars": {"PYTHONPATH": str(Path(__file__).resolve().parent.parent)
                                       + os.pathsep + os.environ.get("PYTHONPATH", "")}})
    try:
        engine = ray.remote(SGLangEngine).options(num_gpus=1, max_concurrency=8).remote(model_path, "float32")
        prompts = [{"prompt_ids": [2, 4 + i, 5, 6], "max_new_tokens": 6, "temperature": 0.0} for i in range(4)]
        before = ray.get(engine.generate.remote(prompts))
        assert all(v == 0 for o in before for v in o["versions"])
        state = load_model(model_path).state_dict()
        torch.manual_seed(0)
        changed = {n: t + torch.randn_like(t) * t.std().clamp(min=0.1) for n, t in state.items()}
        ray.get(engine.load_weights.remote(changed, 1))
        after = ray.get(engine.generate.remote(prompts))
        assert ray.get(engine.weight_version.remote()) == 1
        assert all(v == 1 for o in after for v in o["versions"])
        assert [o["response_ids"] for o in after] != [o["response_ids"] for o in before]
        ray.get(engine.close.remote())
    finally:
        ray.shutdown()


def test_sampling_params_carry_the_samples_seed_past_a_prefix():
    r = {"prompt_ids": [2], "max_new_tokens": 8, "temperature": 0.7, "top_p": 0.9, "seed": 41, "prefix_ids": [5, 6]}
    params = SGLangEngine._sampling(r, 6)
    assert params == {"max_new_tokens": 6, "temperature": 0.7, "top_p": 0.9, "skip_special_tokens": False,
                      "no_stop_trim": True, "sampling_seed": 43}
    assert SGLangEngine._sampling({"temperature": 0.0, "top_p": 0.5}, 4)["top_p"] == 1.0   # greedy ignores top_p
