"""The update stage's recipe sections, `algorithm:` and `trainer:` (with `trainer.lora:`), apart from the
losses and the trainer so that a recipe is read and checked without importing torch. The names the torch
modules implement are listed here; tests/test_config_doc.py checks the lists match those modules.
"""
from __future__ import annotations

import dataclasses

from stages.keys import NONNEG, POSITIVE, UNIT, Check, key, one_of, section
from stages.lora_config import LoraConfig

ADVANTAGES = ("grpo", "dr_grpo", "rloo", "reinforce_pp", "reinforce_pp_baseline")   # advantages.ESTIMATORS
SURROGATE_NAMES = ("ppo_clip", "gspo", "cispo")                                      # losses.SURROGATES
KL_ESTIMATOR_NAMES = ("k1", "k2", "k3")                                              # losses.KL_ESTIMATORS
DISTILL_MODES = ("pg", "gkd")                                                        # distill.py

# name -> what the preset fills in. Keys match AlgorithmConfig fields.
PRESETS: dict[str, dict] = {
    "grpo": dict(advantage="grpo", loss="ppo_clip", loss_agg="token_mean"),
    "dr_grpo": dict(advantage="dr_grpo", loss="ppo_clip", loss_agg="seq_mean_token_sum_norm"),
    # DAPO: clip-higher, token-level loss, soft overlong punishment. Its dynamic sampling
    # (drop groups whose rewards all agree) belongs to the batcher, not to the loss.
    "dapo": dict(advantage="grpo", loss="ppo_clip", loss_agg="token_mean", clip_high=0.28, overlong="soft"),
    "gspo": dict(advantage="grpo", loss="gspo", loss_agg="seq_mean_token_mean"),
    "cispo": dict(advantage="grpo", loss="cispo", loss_agg="token_mean"),
    "rloo": dict(advantage="rloo", loss="ppo_clip", loss_agg="token_mean"),
    "reinforce_pp": dict(advantage="reinforce_pp", loss="ppo_clip", loss_agg="token_mean"),
    "reinforce_pp_baseline": dict(advantage="reinforce_pp_baseline", loss="ppo_clip", loss_agg="token_mean"),
}

# (clip_low, clip_high) when neither the user nor the preset sets them. GSPO clips a
# sequence-level ratio (a per-token geometric mean), so its band is ~1000x narrower
# (paper: 3e-4 / 4e-4). CISPO's band bounds the IS weight; clip_low = 1 means "no lower
# bound", as in MiniMax-M1 which tunes only the upper one.
CLIP_DEFAULTS: dict[str, tuple[float, float]] = {
    "ppo_clip": (0.2, 0.2),
    "gspo": (3e-4, 4e-4),
    "cispo": (1.0, 0.28),
}
LOSS_AGGS = ("token_mean", "seq_mean_token_mean", "seq_mean_token_sum_norm")
OVERLONG_MODES = ("none", "mask", "soft")
MIS_LEVELS = ("token", "sequence", "geometric")
ENTROPY_ROWS = ("all", "trained")
_DUAL_CLIP = Check("0 (off) or > 1", lambda c: c == 0 or c > 1)


@section("algorithm")
class AlgorithmConfig:
    name: str = key("grpo", "preset the empty keys below are filled from", one_of(*PRESETS))
    advantage: str = key("", "\"\" = preset's; else an estimator in advantages.ESTIMATORS", one_of("", *ADVANTAGES))
    loss: str = key("", "\"\" = preset's; ppo_clip | gspo | cispo", one_of("", *SURROGATE_NAMES))
    loss_agg: str = key("", "\"\" = preset's; token_mean | seq_mean_token_mean | seq_mean_token_sum_norm",
                            one_of("", *LOSS_AGGS))
    clip_low: float | None = key(None, "None = preset's, else CLIP_DEFAULTS[loss]; ratio >= 1 - clip_low", NONNEG)
    clip_high: float | None = key(None, "None = preset's, else CLIP_DEFAULTS[loss]; ratio <= 1 + clip_high (DAPO "
                                        "clip-higher: 0.28)", NONNEG)
    clip_ratio_c: float = key(3.0, "dual-clip bound on -A*ratio for A < 0 (ppo_clip only; 0 = off, else > 1)",
                              _DUAL_CLIP)
    norm_length: int = key(0, "seq_mean_token_sum_norm's constant length (0 = the generation limit, "
                                "sampling.max_new_tokens, as Dr.GRPO intends: one constant for every step)", NONNEG)
    kl_coef: float = key(0.0, "weight of KL to the reference policy (needs ref log-probs)", NONNEG)
    kl_estimator: str = key("k3", "k1 | k2 | k3 (Schulman's estimators)", one_of(*KL_ESTIMATOR_NAMES))
    entropy_coef: float = key(0.0, "entropy bonus weight (< 0: an entropy penalty, which sharpens the policy)")
    entropy_rows: str = key("all", "all | trained: the entropy term only on rows the policy gradient trains (a nonzero"
                                   " advantage), so zero-advantage rows still need no forward pass",
                                   one_of(*ENTROPY_ROWS))
    overlong: str = key("", "\"\" = preset's; none | mask (drop truncated) | soft (length penalty)",
                            one_of("", *OVERLONG_MODES))
    overlong_buffer: int = key(0, "soft: tokens before the limit where the penalty ramps (0 = limit // 5)", NONNEG)
    overlong_penalty: float = key(1.0, "soft: penalty at the limit", NONNEG)
    tis_cap: float = key(0.0, "truncated IS: weight = min(ratio, tis_cap) (0 = off)", NONNEG)
    mis_low: float = key(0.0, "masked IS: drop what has ratio outside [mis_low, mis_high]", UNIT)
    mis_high: float = key(0.0, "masked IS upper bound, >= 1 (0 = off)", NONNEG)
    mis_level: str = key("token", "token | sequence (product of ratios) | geometric (their geometric mean)",
                                  one_of(*MIS_LEVELS))
    geo_is: bool = key(False, "IS weight = per-sequence geometric mean of token ratios")
    decoupled: bool = key(False, "use the engine's log-probs as the \"old\" policy (no recompute)")
    distill_coef: float = key(0.0, "on-policy distillation weight (needs a `teacher:` section; 0 = off)", NONNEG)
    task_coef: float = key(1.0, "weight of the task (reward) advantage when distilling", NONNEG)
    distill: str = key("pg", "pg: advantage += log pi_T - log pi_S | gkd: + top-k KL term in the loss",
                             one_of(*DISTILL_MODES))

    def __post_init__(self):
        if self.mis_high and not 0 <= self.mis_low <= 1 <= self.mis_high:
            raise ValueError("algorithm.mis_low <= 1 <= mis_high is needed, or mis_high = 0 to turn MIS off")
        if self.decoupled and (self.tis_cap or self.mis_high or self.geo_is):
            # With the engine log-probs as the old policy, the old/engine ratio is 1 everywhere.
            raise ValueError("algorithm.decoupled=true makes tis_cap/mis_*/geo_is no-ops; turn one side off")

    def for_generation_limit(self, max_new_tokens: int) -> AlgorithmConfig:
        """This config with norm_length defaulted to the rollout's generation limit, so Dr.GRPO's
        constant-length normaliser is the same every step (not the step's longest response)."""
        if self.norm_length or max_new_tokens <= 0:
            return self
        return dataclasses.replace(self, norm_length=int(max_new_tokens))

    def resolved(self) -> AlgorithmConfig:
        """This config with every empty field filled from the preset, then from CLIP_DEFAULTS."""
        preset = PRESETS[self.name]
        fallback = dict(zip(("clip_low", "clip_high"), CLIP_DEFAULTS[self.loss or preset["loss"]]), overlong="none")
        filled = {k: v for k, v in (fallback | preset).items() if getattr(self, k) in ("", None)}
        return dataclasses.replace(self, **filled) if filled else self


ON_NONFINITE = ("skip", "stop")
LR_SCHEDULES = ("constant", "linear", "cosine")
_BETAS = Check("two numbers, each in [0, 1)", lambda b: len(b) == 2 and all(0 <= x < 1 for x in b))


@section("trainer")
class TrainerConfig:
    lr: float = key(2e-4, "peak learning rate (AdamW)", POSITIVE)
    weight_decay: float = key(0.0, "AdamW weight decay", NONNEG)
    betas: tuple[float, float] = key((0.9, 0.98), "AdamW betas", _BETAS)
    grad_clip: float = key(1.0, "clip the gradient's global norm to this", POSITIVE)
    mini_batch_size: int = key(0, "samples per optimizer step; 0 = the whole step (one optimizer step)", NONNEG)
    ppo_epochs: int = key(1, "passes over a step's samples", POSITIVE)
    num_threads: int = key(0, "torch threads in the trainer actor; 0 = pipeline/resources.py decides", NONNEG)
    seed: int = key(0, "set from run.seed (pipeline/seeds.py), not a recipe key", NONNEG)
    backend: str = key("torch", "torch (this module) | megatron (stages/update/megatron, `megatron:` section)",
                                one_of("torch", "megatron"))
    lr_schedule: str = key("constant", "constant | linear | cosine: decay from lr to lr * lr_min_ratio",
                                       one_of(*LR_SCHEDULES))
    lr_warmup_steps: int = key(0, "training steps of linear warm-up from lr / lr_warmup_steps to lr", NONNEG)
    lr_min_ratio: float = key(0.0, "where linear / cosine decay ends, as a fraction of lr", UNIT)
    lr_decay_steps: int = key(0, "the step the decay ends at (0 = run.steps, the run's last step)", NONNEG)
    skip_zero_advantage: bool = key(True, "no forward/backward for rows whose every trained token has advantage 0 "
                                          "(a group of equal rewards): they add nothing to the gradient and the loss "
                                          "keeps their tokens in its denominator, so the update is the same with less "
                                          "compute. Off by itself with a KL-to-reference, entropy or distillation term")
    share_prompts: bool = key(True, "rows of a mini-batch with the same prompt (a group's samples) run as one "
                                    "sequence: the prompt once, each response attending to it and to itself (the same "
                                    "log-probs; the prompt's compute paid once, not per sample)")
    mini_batch_split: str = key("rows", "rows: mini-batches of random rows | groups: of whole groups (their rows share"
                                        " a prompt, so share_prompts computes it once per mini-batch)",
                                        one_of("rows", "groups"))
    on_nonfinite: str = key("skip", "a mini-batch whose loss or grad norm is NaN / inf: skip (its optimizer step is "
                                    "not taken; counted as train/nonfinite_skipped) | stop (raise)",
                                    one_of(*ON_NONFINITE))
    logprob_chunk: int = key(256, "response positions whose logits exist at once: log-probs and entropy on response "
                                  "positions only, the LM head applied this many at a time (each chunk recomputed in "
                                  "the backward), so memory follows the response, never [sequence, vocabulary] (256 x "
                                  "151k vocab = 155 MB fp32). 0 = every response position of a mini-batch at once",
                             NONNEG)
    max_tokens_per_microbatch: int = key(0, "> 0: an optimizer step's rows run in forward/backward passes of at most "
                                            "this many laid-out positions each (rows x longest row, or packed width), "
                                            "gradients accumulated: one 19k-token row and many short ones train in one "
                                            "step without padding every row to 19k (stages/update/microbatch.py); the "
                                            "update equals one pass's to float rounding. 0 = one pass per mini-batch",
                                         NONNEG)
    activation_checkpointing_tokens: int = key(16384, "a forward/backward pass laying out more than this many "
                                                      "positions (rows x longest row) keeps only each decoder layer's "
                                                      "input and recomputes the layer in the backward (HF activation "
                                                      "checkpointing): long rows hold one layer's activations at a "
                                                      "time, for one more forward of compute. 0 = never", NONNEG)
    lora: LoraConfig = key(LoraConfig, "train LoRA adapters only (stages/lora.py)")

    def __post_init__(self):
        if self.lora.enabled and self.backend != "torch":
            raise ValueError(f"trainer.lora.enabled needs trainer.backend=torch: the {self.backend} trainer has no "
                             "LoRA (peft adapts HF modules; Megatron's are its own, sharded)")
