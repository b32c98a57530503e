"""The `trainer.lora:` recipe section (stages/lora.py uses it), apart so a recipe is checked without torch."""
from __future__ import annotations

import re

from stages.keys import POSITIVE, between, key, one_of, section

DEFAULT_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


@section("trainer.lora")
class LoraConfig:
    enabled: bool = key(False, "train LoRA adapters instead of the full model")
    rank: int = key(8, "adapter rank", POSITIVE)
    alpha: float = key(16.0, "the update is scaled by alpha / rank", POSITIVE)
    dropout: float = key(0.0, "on the adapter's input, in the trainer's gradient passes only",
                              between(0, 1, hi_open=True))
    target_modules: tuple[str, ...] = key(DEFAULT_TARGETS, "module names: every module whose path ends in one")
    target_regex: str = key("", "a regex full-matched against module paths; set, it replaces target_modules")
    modules_to_save: tuple[str, ...] = key((), "modules trained in full beside the adapters (peft's modules_to_save: "
                                               "every module whose path ends in one), e.g. [model.norm]; sent with "
                                               "them")
    serve: str = key("merge", "how the HF engine applies a version: merge | peft (see stages/lora.py)",
                     one_of("merge", "peft"))

    def __post_init__(self):
        if self.target_regex:
            try:
                re.compile(self.target_regex)
            except re.error as e:
                raise ValueError(f"trainer.lora.target_regex={self.target_regex!r} is not a valid regex: {e}") from e
        elif not self.target_modules:
            raise ValueError("trainer.lora.target_modules is empty (and no trainer.lora.target_regex is set)")

    @property
    def scaling(self) -> float:
        return self.alpha / self.rank

    @property
    def targets_key(self) -> str:
        return "trainer.lora.target_regex" if self.target_regex else "trainer.lora.target_modules"

    @property
    def targets_spec(self):
        """What peft's LoraConfig takes as target_modules: a regex string, or a list of names."""
        return self.target_regex or list(self.target_modules)
