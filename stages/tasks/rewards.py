"""Shaped training rewards for the built-in digit-string tasks (reward.fn plugs them in by path).

Why: with exact match a weak policy gets reward 0 on nearly every sample, so most GRPO groups
agree and carry no signal. Partial credit per answer character gives groups that disagree
far more often. Only an exact, finished answer scores 1.0, so eval/accuracy (the fraction
of samples with reward 1) still measures exact-match accuracy when a recipe trains on this.

Signature (see stages/reward.py): fn(prompt, response, answer, row) -> float.
"""
from __future__ import annotations

PARTIAL_MAX = 0.5   # best score of a wrong answer: well below the 1.0 of an exact one


def digit_match(prompt: str, response: str, answer: str, row: dict) -> float:
    """1.0 for the exact answer ended by <eos>; otherwise PARTIAL_MAX x the fraction of answer
    characters right in place, counted from the last digit (the ones digit is the easiest to
    get right and the one carries propagate from), divided by the longer of the two lengths
    so that padding an answer with extra characters never pays."""
    response, answer = response.strip(), answer.strip()
    finished = row.get("status") == "completed"
    if finished and response == answer:
        return 1.0
    if not answer:
        return 0.0
    right = sum(r == a for r, a in zip(reversed(response), reversed(answer)))
    score = PARTIAL_MAX * right / max(len(response), len(answer))
    return score if finished else score / 2   # an unfinished answer earns half its partial credit
