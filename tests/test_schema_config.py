import pyarrow as pa
import pytest

from pipeline.config import ConfigError, load_config, to_dict
from stages.schema import (
    COLUMNS,
    OPTIONAL,
    SCHEMA_VERSION,
    TRAJECTORY_SCHEMA,
    conform,
    table_from_columns,
    with_columns,
)


def test_schema_has_design_columns_and_version():
    for c in ("prompt_id", "group_id", "sample_idx", "data_source", "prompt", "prompt_ids", "response_ids",
              "response_logprobs", "loss_mask", "token_versions", "version_start", "version_end", "status",
              "error", "reward", "reward_info", "teacher_id", "teacher_logprobs", "t_dispatch", "t_done"):
        assert c in COLUMNS
    assert TRAJECTORY_SCHEMA.metadata[b"loongsage.schema_version"] == str(SCHEMA_VERSION).encode()


def test_with_columns_types_and_conform_fills_optional():
    t = table_from_columns({"group_id": [1, 2]})
    assert t.schema.field("group_id").type == pa.int64()
    t = with_columns(t, {"group_id": [3, 4], "extra": ["a", "b"]})
    assert t.column("group_id").to_pylist() == [3, 4] and "extra" in t.column_names
    with pytest.raises(ValueError, match="lacks columns"):
        conform(t)
    full = {c: [None] for c in COLUMNS if c not in OPTIONAL}
    out = conform(pa.table(full))
    assert out.column_names[: len(COLUMNS)] == list(COLUMNS)


def test_config_defaults_overrides_and_types():
    cfg = load_config("configs/quickstart.yaml", ["trainer.lr=0.001", "rollout.n_samples=4", "run.steps=3"])
    assert cfg.trainer.lr == 0.001 and cfg.rollout.n_samples == 4 and cfg.run.steps == 3
    assert to_dict(cfg)["batcher"]["groups_per_step"] == cfg.batcher.groups_per_step


def test_exponent_floats_without_a_dot(tmp_path):
    # PyYAML (YAML 1.1) reads 5e-5 as the string '5e-5': a float key takes it, in a file and an override
    cfg = load_config(None, ["trainer.lr=5e-5", "algorithm.entropy_coef=-2E-2", "algorithm.clip_high=+1e0"])
    assert (cfg.trainer.lr, cfg.algorithm.entropy_coef, cfg.algorithm.clip_high) == (5e-5, -0.02, 1.0)
    f = tmp_path / "r.yaml"
    f.write_text("trainer:\n  lr: 3e-4\n")
    assert load_config(f).trainer.lr == 3e-4
    with pytest.raises(ConfigError, match="run.steps: expected int"):     # an int key stays strict
        load_config(None, ["run.steps=1e3"])


def test_unknown_key_lists_valid_keys():
    with pytest.raises(ConfigError, match=r"unknown key rollout\.n_sample; valid keys of rollout: n_samples"):
        load_config(None, ["rollout.n_sample=3"])
    with pytest.raises(ConfigError, match="unknown key bogus"):
        load_config(None, ["bogus.x=1"])


def test_a_moved_key_is_refused_naming_its_new_place(tmp_path):
    with pytest.raises(ConfigError, match=r"^rollout\.max_new_tokens is now sampling\.max_new_tokens$"):
        load_config(None, ["rollout.max_new_tokens=4"])
    f = tmp_path / "old.yaml"
    f.write_text("rollout:\n  n_samples: 4\n  engine: vllm\n  sandbox: {workers: 2}\n")
    with pytest.raises(ConfigError) as e:
        load_config(f)
    assert str(e.value) == "rollout.engine is now engine.kind; rollout.sandbox is now sandbox"
    cfg = load_config(None, ["engine.kind=hf", "sandbox.workers=3", "agent.name=retry", "proxy.port=0"])
    assert (cfg.engine.kind, cfg.sandbox.workers, cfg.agent.name) == ("hf", 3, "retry")


@pytest.mark.parametrize("override,key", [
    ("batcher.groups_per_step=0", "batcher.groups_per_step"),
    ("rollout.n_samples=-1", "rollout.n_samples"),
    ("trainer.mini_batch_size=-4", "trainer.mini_batch_size"),
    ("rollout.stale_steps=-1", "rollout.stale_steps"),
    ("run.data_wake=sometimes", "run.data_wake"),
    ("rollout.nice=20", "rollout.nice"),
])
def test_bad_sizes_fail_with_key(override, key):
    with pytest.raises(ConfigError, match=key.replace(".", r"\.")):
        load_config(None, [override])


def test_wrong_type_and_missing_file(tmp_path):
    with pytest.raises(ConfigError, match="trainer.lr: expected float"):
        load_config(None, ["trainer.lr=fast"])
    with pytest.raises(ConfigError, match="config file not found"):
        load_config(tmp_path / "nope.yaml")
