"""The `data:` recipe section (stages/prompts.py reads it), apart so a recipe is checked without pyarrow."""
from __future__ import annotations

from stages.keys import NONNEG, POSITIVE, key, section


@section("data")
class DataConfig:
    path: str = key("builtin:addition", ".parquet / .jsonl / .json file, a directory of Parquet, or builtin:TASK")
    test_path: str = key("", "held-out prompts for eval; \"\" = the built-in task's test split")
    prompt_key: str = key("prompt", "column holding the prompt")
    answer_key: str = key("answer", "column holding the reference answer")
    data_source_key: str = key("data_source", "optional column naming each row's data source; missing -> "
                                              "data.data_source")
    data_source: str = key("", 'default source name ("" = task name or file stem)')
    builtin_digits: int = key(2, "builtin:TASK: digits of the task's operands", POSITIVE)
    train_size: int = key(0, "training prompts to use (0 = every row)", NONNEG)
    shuffle: bool = key(True, "shuffle prompts, one seeded permutation per epoch")
    seed: int = key(0, "set from run.seed (pipeline/seeds.py), not a recipe key: the prompt order", NONNEG)
