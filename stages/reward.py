"""Reward stage: trajectories -> scalar rewards, built-in rules or a user function.

Input columns:  prompt, answer, response_ids, status
                (optional, from AgentFlow: agent_reward, agent_info, transcript)
Output columns: reward, reward_info, status, error

User reward functions plug in by dotted path (`reward.fn: mypkg.rewards:score`) with the
signature

    def score(prompt: str, response: str, answer: str, row: dict) -> float | dict
        # dict form: {"reward": float, ...anything else goes to reward_info}

(`async def` works too). The function runs in a worker thread with a timeout: an
exception or a timeout marks only that row `failed`, with the error and reward 0.

Agents: when the agent itself reported a reward (a black-box agent's last stdout line,
an environment's rewards) the row's `agent_reward` is the reward and reward.fn is not
called; reward_info is {"source": "agent", ...the agent's info}. Otherwise, for rows with
a transcript, `response` is the final model turn's text and `row["transcript"]` the whole
final transcript as a list of {role, content} (chat messages for black-box agents).
"""
from __future__ import annotations

import asyncio
import concurrent.futures as cf
import importlib
import json
import re
from dataclasses import dataclass

import pyarrow as pa

from stages.schema import with_columns

DECODE_CACHE_ROWS = 65536     # decoded responses kept per reward worker
_NUM = re.compile(r"-?\d+(?:\.\d+)?")


def exact_match(prompt: str, response: str, answer: str, row: dict) -> float:
    """1 iff the model ended its answer (eos) and the text before it equals the answer."""
    return float(row.get("status") == "completed" and response.strip() == answer.strip())


def numeric(prompt: str, response: str, answer: str, row: dict) -> float:
    """1 iff the last number in the response equals the answer numerically."""
    found = _NUM.findall(response)
    try:
        return float(bool(found) and abs(float(found[-1]) - float(answer)) < 1e-6)
    except ValueError:
        return 0.0


BUILTIN = {"exact_match": exact_match, "numeric": numeric}


@dataclass(frozen=True)
class RewardConfig:
    fn: str = "exact_match"        # exact_match | numeric | dotted path `pkg.module:function`
    timeout_s: float = 10.0        # per row
    num_threads: int = 4


def load_reward_fn(name: str):
    if name in BUILTIN:
        return BUILTIN[name]
    mod, sep, attr = name.replace(":", ".").rpartition(".")
    if not sep or not mod:
        raise ValueError(f"reward.fn {name!r}: not a built-in ({', '.join(BUILTIN)}) nor a dotted path")
    try:
        fn = getattr(importlib.import_module(mod), attr)
    except (ImportError, AttributeError) as e:
        raise ValueError(f"reward.fn {name!r} does not import: {e}") from e
    if not callable(fn):
        raise ValueError(f"reward.fn {name!r} is not callable")
    return fn


def _has_agent_reward(row: dict) -> bool:
    return row.get("agent_reward") is not None and row["status"] not in ("failed", "aborted")


class Reward:
    inputs = ("prompt", "answer", "response_ids", "status")
    outputs = ("reward", "reward_info", "status", "error")

    def __init__(self, cfg: RewardConfig, model_path: str = "", nice: int = 0):
        from stages.model import load_tokenizer
        from stages.priority import lower_priority

        lower_priority(nice)
        self.cfg = cfg
        self.fn = load_reward_fn(cfg.fn)
        self.tok = load_tokenizer(model_path)
        self.pool = cf.ThreadPoolExecutor(max_workers=cfg.num_threads)
        self._texts: dict[tuple, str] = {}    # response ids -> text: a group's samples often give the same answer

    def __call__(self, batch: pa.Table) -> pa.Table:
        rows = batch.to_pylist()
        futures = [None if r["status"] in ("failed", "aborted") or _has_agent_reward(r) else
                   self.pool.submit(self._score, r) for r in rows]
        out = {k: [] for k in self.outputs}
        for r, fut in zip(rows, futures):
            reward, info, status, error = 0.0, {}, r["status"], r.get("error") or ""
            if _has_agent_reward(r):
                reward, info = r["agent_reward"], {"source": "agent", **json.loads(r.get("agent_info") or "{}")}
            elif fut is not None:
                try:
                    reward, info = fut.result(timeout=self.cfg.timeout_s)
                except cf.TimeoutError:
                    status, error = "failed", f"reward.fn {self.cfg.fn} timed out after {self.cfg.timeout_s}s"
                except Exception as e:  # noqa: BLE001 - user code: fail the row, keep the run
                    status, error = "failed", f"reward.fn {self.cfg.fn} raised {type(e).__name__}: {e}"
            out["reward"].append(float(reward))
            out["reward_info"].append(json.dumps(info))
            out["status"].append(status)
            out["error"].append(error)
        return with_columns(batch, out)

    def _text(self, ids: list[int]) -> str:
        key = tuple(ids)
        text = self._texts.get(key)
        if text is None:
            eos = self.tok.eos_token_id
            text = self.tok.decode(ids[: ids.index(eos)] if eos in ids else ids, skip_special_tokens=True)
            if len(self._texts) >= DECODE_CACHE_ROWS:
                self._texts.clear()
            self._texts[key] = text
        return text

    def _score(self, row: dict) -> tuple[float, dict]:
        transcript = json.loads(row.get("transcript") or "[]")
        if transcript:  # an agent's trajectory: the final model turn is the answer
            row = row | {"transcript": transcript}
            text = next((m["content"] or "" for m in reversed(transcript) if m["role"] == "assistant"), "")
        else:
            text = self._text(row["response_ids"])
        res = self.fn(row["prompt"], text, row.get("answer") or "", row)
        if asyncio.iscoroutine(res):
            res = asyncio.run(res)
        if isinstance(res, dict):
            if "reward" not in res:
                raise ValueError(f"reward dict has no 'reward' key: {sorted(res)}")
            info = {k: v for k, v in res.items() if k != "reward"}
            return float(res["reward"]), info
        return float(res), {}
