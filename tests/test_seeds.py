"""run.seed: every seed of a run derives from it (pipeline/seeds.py); same seed, same synchronous run."""
import json

import pyarrow.parquet as pq
import pytest
import yaml

from pipeline import seeds
from pipeline.config import ConfigError, dump_config, load_config
from pipeline.metrics import read_metrics
from stages.prompts import PromptSource
from stages.schema import table_from_columns


def test_streams_are_deterministic_distinct_and_in_range():
    assert seeds.derive(0, "engine", 1) == seeds.derive(0, "engine", 1)
    drawn = [seeds.derive(s, name, *idx) for s in (0, 1, 2) for name in seeds.STREAMS for idx in ((), (0,), (1,))]
    assert len(set(drawn)) == len(drawn)          # no two streams, indices or run seeds share a seed
    assert all(0 <= x < 2 ** 31 for x in drawn)
    with pytest.raises(ValueError, match="unknown seed stream 'enigne'"):
        seeds.derive(0, "enigne")


def test_run_seed_sets_every_stage_seed_and_is_the_only_seed_key(tmp_path):
    a, b = load_config("configs/quickstart.yaml"), load_config("configs/quickstart.yaml", ["run.seed=1"])
    for path, stream in seeds.DERIVED:
        got = [getattr(c, path).seed for c in (a, b)]
        assert got == [seeds.derive(0, stream), seeds.derive(1, stream)]
    assert a.model == b.model       # the built-in model (its warm-up, cached on disk) is the recipe's, not the seed's
    with pytest.raises(ConfigError, match="trainer.seed is not a recipe key.*set run.seed"):
        load_config("configs/quickstart.yaml", ["trainer.seed=3"])
    with pytest.raises(ConfigError, match="run.seed must be >= 0"):
        load_config("configs/quickstart.yaml", ["run.seed=-1"])
    dump_config(b, tmp_path / "config.yaml")     # RUN/config.yaml: run.seed alone, and it loads back the same
    assert load_config(tmp_path / "config.yaml") == b
    tree = yaml.safe_load((tmp_path / "config.yaml").read_text())
    for path, _ in seeds.DERIVED:
        node = tree
        for k in path.split("."):
            node = node[k]
        assert "seed" not in node, path
    assert tree["run"]["seed"] == 1


def test_prompt_order_follows_the_seed():
    rows = [{"prompt": f"{i}+1=", "answer": str(i + 1)} for i in range(50)]

    def order(run_seed):
        cfg = load_config("configs/quickstart.yaml", [f"run.seed={run_seed}"])
        return PromptSource(cfg.data, 1, rows=rows).groups(range(100)).column("prompt").to_pylist()

    assert order(0) == order(0) and order(0) != order(1)
    assert sorted(order(1)[:50]) == sorted(r["prompt"] for r in rows)     # an epoch is a permutation


def test_a_reward_fn_gets_a_seed_per_sample_from_the_run_seed(tiny_model_dir):
    from stages.reward import Reward

    def seeds_seen(run_seed):
        cfg = load_config("configs/quickstart.yaml", [f"run.seed={run_seed}", "reward.fn=tests.reward_fns:seed_echo",
                                                      "reward.workers=1"])
        reward = Reward(cfg.reward, tiny_model_dir)
        try:
            batch = table_from_columns({"group_id": [0, 0, 1, 1], "sample_idx": [0, 1, 0, 1], "prompt": ["1+1="] * 4,
                                        "answer": ["2"] * 4, "response_ids": [[1]] * 4, "status": ["completed"] * 4})
            return [json.loads(i)["seed"] for i in reward(batch).column("reward_info").to_pylist()]
        finally:
            reward.close()

    zero = seeds_seen(0)
    assert len(set(zero)) == 4 and seeds_seen(0) == zero and not set(seeds_seen(1)) & set(zero)


# The quickstart recipe on 4 of its prompts, one epoch a step: tiny steps, the same prompts under both seeds
TINY = ["eval.every=0", "eval.num_prompts=0", "batcher.groups_per_step=4", "rollout.n_samples=4",
        "sampling.max_new_tokens=4", "engine.count=1", "trainer.mini_batch_size=0", "trainer.lr=0.001",
        "reward.fn=stages.tasks.rewards:digit_match"]
ROLLOUT = ("rollout/reward_mean", "rollout/response_len", "rollout/tokens", "rollout/samples")


def _outcome(m: dict) -> dict:
    """A step's metrics that depend on what was sampled and trained (every train/ figure but its time)."""
    return {k: v for k, v in m.items() if k.startswith("train/") and k != "train/seconds"} | {k: m[k] for k in ROLLOUT}


def _rollouts(run_dir, step: int) -> list[dict]:
    return pq.read_table(run_dir / "rollouts" / f"step={step:06d}",
                         columns=["prompt_id", "sample_idx", "response_ids", "response_logprobs", "reward"]).to_pylist()


@pytest.mark.e2e
def test_same_seed_same_run_other_seed_other_rollouts(ray_session, tiny_model_dir, tmp_path):
    from pipeline.cli import main
    from pipeline.controller import run
    from stages.tasks import get_task

    data = tmp_path / "prompts.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in get_task("addition", digits=2).make_rows("train", 4)))
    base = TINY + [f"model.path={tiny_model_dir}", f"data.path={data}"]
    for name, extra in (("a", ["run.steps=4", "run.seed=0"]), ("other", ["run.steps=1", "run.seed=1"])):
        run(load_config("configs/quickstart.yaml", base + extra), tmp_path / name, log=lambda *_: None)
    # the same recipe again through the CLI, its option before the overrides
    assert main(["run", "configs/quickstart.yaml", "--run-dir", str(tmp_path / "b"), *base, "run.steps=4"]) == 0

    a, b = ([m for m in read_metrics(tmp_path / r) if "train/loss" in m] for r in ("a", "b"))
    assert [m["step"] for m in a] == [m["step"] for m in b] == [1, 2, 3, 4]
    for ma, mb in zip(a, b):        # synchronous, same seed: bit-identical, not approximately equal
        assert _outcome(ma) == _outcome(mb) and "train/loss" in _outcome(ma)
    for step in (1, 2, 3, 4):
        assert _rollouts(tmp_path / "a", step) == _rollouts(tmp_path / "b", step)

    first, other = _rollouts(tmp_path / "a", 1), _rollouts(tmp_path / "other", 1)
    assert [r["prompt_id"] for r in first] != [r["prompt_id"] for r in other]     # another prompt order
    by_sample = {(r["prompt_id"], r["sample_idx"]): r["response_ids"] for r in first}
    assert by_sample.keys() == {(r["prompt_id"], r["sample_idx"]) for r in other}  # the same prompts, ...
    differ = sum(by_sample[r["prompt_id"], r["sample_idx"]] != r["response_ids"] for r in other)
    assert differ >= len(other) // 2, f"only {differ} of {len(other)} samples differ"    # ... other samples
