"""vLLM as the rollout engine (stages/agentflow/vllm_engine.py): the real engine, on CPU.

The `vllm` tier (deselected by default; `.ci/run` runs it in a virtual environment with
`.[vllm]` installed): generation under the engine contract, log-probs against the trainer,
versions landed in place through the TransferMesh (the same greedy tokens and log-probs as a
fresh engine on those weights), abort and resume, and an engine process killed and restored.
Engines start in 20-80 s here: the module shares one, and only the tests that need another
start one.
"""
from __future__ import annotations

import os
import signal
import threading
import time

import pyarrow as pa
import pytest
import torch

pytestmark = pytest.mark.vllm
pytest.importorskip("vllm", reason="vLLM is not installed (pip install -e '.[vllm]')")

import ray  # noqa: E402

import transfer  # noqa: E402
from stages.agentflow.limits import model_limits  # noqa: E402
from stages.agentflow.vllm_engine import VLLMConfig, VLLMEngine  # noqa: E402
from stages.transfer_config import TransferConfig  # noqa: E402
from stages.update.losses import AlgorithmConfig  # noqa: E402
from stages.update.step import to_batch  # noqa: E402
from stages.update.trainer import TorchTrainer, TrainerConfig  # noqa: E402
from tests.support.engine_checks import check_generation, check_refusals, check_resume  # noqa: E402

CFG = VLLMConfig(kv_cache_mb=64)
PROMPTS = ["12+7=", "3+45=", "99+9=", "40+2=", "5+5=", "61+30=", "8+88=", "23+23="]


def remote_engine(model_dir: str, seed: int = 0, **opts):
    # 2 threads: vLLM's CPU attention checks that its plan and its kernels agree on the thread count
    return ray.remote(VLLMEngine).options(num_cpus=0.1, max_concurrency=16, **opts).remote(
        model_dir, "float32", seed, 2, "engine0", CFG)


@pytest.fixture(scope="module")
def engine(ray_session, tiny_model_dir):
    e = remote_engine(tiny_model_dir)
    ray.get(e.info.remote())
    yield e
    ray.kill(e)


@pytest.fixture(scope="module")
def tok(tiny_model_dir):
    from stages.model import load_tokenizer

    return load_tokenizer(tiny_model_dir)


def reqs(tok, prompts=PROMPTS, **kw):
    return [{"prompt_ids": tok(p, add_special_tokens=False)["input_ids"], "max_new_tokens": 6,
             "temperature": 1.0} | kw for p in prompts]


def rows_of(requests, outs) -> pa.Table:
    return pa.Table.from_pylist([
        {"prompt_ids": r["prompt_ids"], "response_ids": o["response_ids"], "response_logprobs": o["logprobs"],
         "loss_mask": [1] * len(o["response_ids"]), "token_versions": o["versions"], "reward": float(i % 2),
         "group_id": i // 4, "status": o["status"]} for i, (r, o) in enumerate(zip(requests, outs))])


def test_generation_follows_the_engine_contract(engine, tok, tiny_model_dir):
    """The contract's checks (tests/support/engine_checks.py), as the HF engine passes them: token ids in; ids,
    log-probs and versions out; stop on eos or budget; a seeded sample draws the same tokens whatever it is
    batched with; n samples of one prompt; rows that cannot be served fail alone; resumed rows keep their
    prefix. And vLLM's own refusal: temperatures above 2 fail the row alone."""
    generate = lambda rows: ray.get(engine.generate.remote(rows))  # noqa: E731
    prompts = [tok(p, add_special_tokens=False)["input_ids"] for p in PROMPTS]
    check_generation(generate, tok.eos_token_id, prompts)
    check_refusals(generate, tok.eos_token_id, prompts, model_limits(tiny_model_dir)[0])
    check_resume(generate, tok.eos_token_id, prompts)
    too_hot = generate(reqs(tok, ["1+1="], temperature=3.0) + reqs(tok, ["2+2="]))
    assert too_hot[0]["status"] == "failed" and "temperature" in too_hot[0]["error"]
    assert too_hot[1]["status"] in ("completed", "truncated")


def test_logprobs_match_the_trainer(engine, tok, tiny_model_dir):
    """The sampled tokens' log-probs are the trainer's for the same weights: k3 (the KL estimate the
    trainer logs for the engine/trainer gap) <= 1e-4 on fresh tokens, at temperature 1 and 0.7."""
    for temp in (1.0, 0.7):
        requests = reqs(tok, PROMPTS * 4, temperature=temp, seed=7)
        for i, r in enumerate(requests):
            r["seed"] = i
        outs = ray.get(engine.generate.remote(requests))
        tr = TorchTrainer(tiny_model_dir, TrainerConfig(num_threads=1), AlgorithmConfig(), temp)
        b = to_batch(rows_of(requests, outs), tr.pad_id)
        with torch.no_grad():
            lp = tr.logprobs(tr.model, b)[0]
        d = (lp - b.engine_lp) * b.mask
        k3 = ((d.exp() - 1 - d) * b.mask).sum() / b.mask.sum()
        assert k3 <= 1e-4 and d.abs().max() < 1e-3, (temp, float(k3), float(d.abs().max()))


def test_a_version_lands_in_place_as_a_fresh_engine_would_serve_it(engine, tok, tiny_model_dir, tmp_path):
    """A trainer step, published over the TransferMesh (shared memory): the running engine serves the new
    weights with the new version, and gives the greedy tokens and log-probs of an engine started on them."""
    trainer = ray.remote(TorchTrainer).options(num_cpus=0.1, max_concurrency=2).remote(
        tiny_model_dir, TrainerConfig(num_threads=1, lr=3e-3), AlgorithmConfig())
    mesh = transfer.TransferMesh(trainer, {"engine0": engine},
                                 TransferConfig(transport="shm", bucket_bytes=256 << 10))
    assert mesh.plan()["engine0"].transport == "shm"
    requests = reqs(tok, PROMPTS * 2)
    greedy = reqs(tok, temperature=0.0)
    before = ray.get(engine.generate.remote(greedy))
    for version in (1, 2):
        ray.get(trainer.train_step.remote(rows_of(requests, ray.get(engine.generate.remote(requests)))))
        metrics = mesh.publish(version)
        assert metrics["transfer/receivers"] == 1 and ray.get(engine.weight_version.remote()) == version
    after = ray.get(engine.generate.remote(greedy))
    assert all(set(o["versions"]) == {2} for o in after)
    assert [o["response_ids"] for o in after] != [o["response_ids"] for o in before] or \
        [o["logprobs"] for o in after] != [o["logprobs"] for o in before]
    ray.get(trainer.save.remote(str(tmp_path / "v2"), tiny_model_dir, False))
    fresh = remote_engine(str(tmp_path / "v2"))
    try:
        expected = ray.get(fresh.generate.remote(greedy))
    finally:
        ray.kill(fresh)
    assert [o["response_ids"] for o in after] == [o["response_ids"] for o in expected]
    for a, e in zip(after, expected):
        assert a["logprobs"] == pytest.approx(e["logprobs"], abs=1e-5)
    mesh.close()
    ray.kill(trainer)
    # the rest of the module expects the engine on version-0 weights
    base = TorchTrainer(tiny_model_dir, TrainerConfig(num_threads=1), AlgorithmConfig())
    ray.get(engine.load_weights.remote(base.state_dict(), 0))
    assert ray.get(engine.generate.remote(greedy)) == before


def long_requests(tok, n: int = 96):
    """Rows that run long: vLLM's highest temperature keeps eos rarer (it ends rows the model finishes)."""
    return [{"prompt_ids": tok("1+", add_special_tokens=False)["input_ids"], "max_new_tokens": 60,
             "temperature": 2.0, "seed": i} for i in range(n)]


def test_abort_returns_partial_rows_that_resume(engine, tok):
    """abort_all ends the rows in flight with the tokens they have; a row sent again with that prefix
    completes it, keeping the prefix's log-probs and versions."""
    requests = long_requests(tok)
    ref = engine.generate.remote(requests)
    time.sleep(0.05)
    ray.get(engine.abort_all.remote())
    outs = ray.get(ref)
    aborted = [(r, o) for r, o in zip(requests, outs) if o["status"] == "aborted"]
    assert aborted, [o["status"] for o in outs]
    assert all(len(o["response_ids"]) < 60 for _, o in aborted)
    again = [r | {"prefix_ids": o["response_ids"], "prefix_logprobs": o["logprobs"],
                  "prefix_versions": o["versions"]} for r, o in aborted]
    resumed = ray.get(engine.generate.remote(again))
    for (_, o), got in zip(aborted, resumed):
        assert got["status"] in ("completed", "truncated")
        assert got["response_ids"][:len(o["response_ids"])] == o["response_ids"]
        assert got["logprobs"][:len(o["logprobs"])] == o["logprobs"]
        assert len(got["response_ids"]) == len(got["logprobs"]) == len(got["versions"])


def test_a_version_landing_mid_generation_tags_each_token(engine, tok, tiny_model_dir):
    """Partial rollout: rows in flight when a version lands go on under it; their tokens carry 0 then 1.
    A `hold` call keeps one version: the update waits for it."""
    state = TorchTrainer(tiny_model_dir, TrainerConfig(num_threads=1), AlgorithmConfig()).state_dict()
    for attempt in range(5):
        ref = engine.generate.remote(long_requests(tok, 128))
        time.sleep(0.05 * (attempt + 1))
        ray.get(engine.load_weights.remote(state, 1 + attempt))
        outs = ray.get(ref)
        mixed = [o["versions"] for o in outs if len(set(o["versions"])) > 1]
        if mixed:
            break
    assert mixed, "no row was in flight when the version landed"
    assert all(v == sorted(v) for v in mixed)
    held = engine.generate.remote([r | {"hold": True} for r in long_requests(tok, 64)])
    time.sleep(0.05)
    ray.get(engine.load_weights.remote(state, 10))
    assert all(len(set(o["versions"])) == 1 for o in ray.get(held))
    ray.get(engine.load_weights.remote({}, 0))


def test_an_engine_killed_mid_run_is_restored_with_the_current_weights(ray_session, tiny_model_dir, tok):
    """The process dies under a generate call: the caller gets Ray's actor error, Ray restarts the
    actor, and the restarted engine serves nothing until the mesh has re-sent the current version."""
    from ray.exceptions import RayActorError

    e = remote_engine(tiny_model_dir, max_restarts=1)
    trainer = ray.remote(TorchTrainer).options(num_cpus=0.1, max_concurrency=2).remote(
        tiny_model_dir, TrainerConfig(num_threads=1), AlgorithmConfig())
    mesh = transfer.TransferMesh(trainer, {"engine0": e}, TransferConfig(transport="shm"))
    mesh.publish(3)
    first = ray.get(e.info.remote())
    ref = e.generate.remote(long_requests(tok, 64))
    time.sleep(0.05)
    os.kill(first["pid"], signal.SIGKILL)
    with pytest.raises(RayActorError):
        ray.get(ref)
    deadline = time.time() + 300
    while True:
        try:
            info = ray.get(e.info.remote(), timeout=60)
            break
        except RayActorError:
            assert time.time() < deadline
            time.sleep(1)
    assert info["incarnation"] != first["incarnation"] and ray.get(e.needs_sync.remote())
    waiting = e.generate.remote(reqs(tok))          # waits for the weights, as the engine watch re-sends them
    threading.Timer(0.5, lambda: (mesh.add_receiver("engine0", e), mesh.publish(3))).start()
    outs = ray.get(waiting, timeout=120)
    assert all(set(o["versions"]) == {3} for o in outs)
    mesh.close()
    for a in (e, trainer):
        ray.kill(a)
