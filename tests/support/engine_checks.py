"""The engine contract's checks (stages/agentflow/engine_contract.py), one engine-agnostic set.

Each check takes `generate` (a function: rows -> results, e.g. `lambda rows: ray.get(e.generate.remote(rows))`)
and the engine's eos id, returns a one-line summary and raises AssertionError where the engine breaks
the contract. Run on the HF engine by tests/test_engine_contract.py, on vLLM by tests/test_vllm_engine.py,
and on SGLang by benchmarks/gpu/sglang_check.py (which prints their summaries as a table).
"""
from __future__ import annotations

from typing import Callable

Generate = Callable[[list[dict]], list[dict]]


def rows(prompts: list[list[int]], **kw) -> list[dict]:
    return [{"prompt_ids": list(p), "max_new_tokens": 6, "temperature": 1.0} | kw for p in prompts]


def check_shapes(outs: list[dict], eos: int, max_new: int, version: int | None = None) -> None:
    """Ids, log-probs and versions line up; eos only last; status says why the row ended."""
    for o in outs:
        n = len(o["response_ids"])
        assert 0 < n == len(o["logprobs"]) == len(o["versions"]) <= max_new, o
        assert all(lp <= 1e-6 for lp in o["logprobs"]), o["logprobs"]
        assert eos not in o["response_ids"][:-1], o
        assert o["status"] == ("completed" if o["response_ids"][-1] == eos else "truncated"), o
        if version is not None:
            assert set(o["versions"]) == {version}, o["versions"]


def check_generation(generate: Generate, eos: int, prompts: list[list[int]], version: int = 0) -> str:
    """n samples of one prompt as n rows, distinct; a seeded row draws the same tokens alone as in a
    batch; greedy is deterministic; every row tagged with the version served."""
    group = rows([prompts[0]] * 8)
    for i, r in enumerate(group):
        r["seed"] = 100 + i
    outs = generate(group + rows(prompts))
    check_shapes(outs, eos, 6, version)
    assert len({tuple(o["response_ids"]) for o in outs[:8]}) > 1, "8 samples of one prompt were all the same"
    alone = generate(group[3:4])[0]
    assert alone["response_ids"] == outs[3]["response_ids"], (alone, outs[3])
    assert max(abs(a - b) for a, b in zip(alone["logprobs"], outs[3]["logprobs"])) < 1e-3
    greedy = rows(prompts, temperature=0.0)
    first, again = generate(greedy), generate(greedy)
    assert [o["response_ids"] for o in first] == [o["response_ids"] for o in again]
    return f"{len(outs)} rows: ids/log-probs/versions aligned, seeded rows reproducible, greedy deterministic"


def check_refusals(generate: Generate, eos: int, prompts: list[list[int]], context: int) -> str:
    """A row over the context and a malformed row fail alone, with a reason; the others are served."""
    too_long = {"prompt_ids": [prompts[0][0]] * (context + 4), "max_new_tokens": 4}
    malformed = {"prompt_ids": "12+7=", "max_new_tokens": 4}
    outs = generate([too_long, *rows(prompts[:2]), malformed])
    assert outs[0]["status"] == "failed" and "context" in outs[0]["error"], outs[0]
    assert outs[-1]["status"] == "failed" and outs[-1]["error"], outs[-1]
    check_shapes(outs[1:3], eos, 6)
    return "over-context and malformed rows failed alone, with a reason"


def check_resume(generate: Generate, eos: int, prompts: list[list[int]]) -> str:
    """A resumed partial rollout keeps its prefix (ids, log-probs, versions) and ends within its budget."""
    first = generate(rows(prompts[:4], max_new_tokens=2, temperature=1.0))
    again = [r | {"max_new_tokens": 6, "prefix_ids": o["response_ids"], "prefix_logprobs": o["logprobs"],
                  "prefix_versions": o["versions"]}
             for r, o in zip(rows(prompts[:4]), first)]
    outs = generate(again)
    for o, got in zip(first, outs):
        k = len(o["response_ids"])
        assert got["response_ids"][:k] == o["response_ids"] and got["logprobs"][:k] == o["logprobs"]
        assert got["versions"][:k] == o["versions"]
        assert len(got["response_ids"]) <= 6 and got["status"] in ("completed", "truncated")
        if o["response_ids"][-1] == eos:        # it had ended: nothing is added
            assert got["response_ids"] == o["response_ids"] and got["status"] == "completed"
    return "resumed rows kept their prefixes"
