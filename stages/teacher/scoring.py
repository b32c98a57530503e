"""Teacher scoring stage: the teacher's log-probs (and with teacher.top_k its top-k) of the student's own
sampled tokens, between rollout and the update. teacher_swaps / _swap_bytes / _swap_s are what a row's
teacher group cost to swap in, on the group's first row, so a sum over rows counts each swap once.

Teachers are frozen, so nothing addresses them from outside: they live in this stage's own actor pool
(the budget is per scoring actor), where the rows already are. Each teacher is visited once per batch,
resident ones first: at most one swap-in per teacher a batch needs. A row its teacher fails on (or with
no teacher) is marked failed with the error.
"""
from __future__ import annotations

import pyarrow as pa
import torch

from stages.model import load_tokenizer
from stages.schema import with_columns
from stages.teacher.config import TeacherConfig
from stages.teacher.manager import TeacherManager
from stages.token_logprobs import position_stats

SKIP = ("failed", "aborted")   # rows an earlier stage already gave up on: nothing to score
ERROR_PREFIX = "teacher stage: "   # every error this stage writes starts so (metrics count them)


def score_rows(model, rows: list[dict], temperature: float, top_k: int, pad_id: int, device,
               chunk: int = 0) -> list[tuple]:
    """(logprobs [T], topk ids [T,k] | None, topk logprobs [T,k] | None) of each row's response tokens,
    right-padded (a causal mask keeps padding off the logits), `chunk` positions at a time."""
    seqs = [torch.tensor(list(r["prompt_ids"]) + list(r["response_ids"]), dtype=torch.long) for r in rows]
    lens, sizes = torch.tensor([len(s) for s in seqs]), [len(r["response_ids"]) for r in rows]
    ids = torch.nn.utils.rnn.pad_sequence(seqs, batch_first=True, padding_value=pad_id)
    attn = (torch.arange(ids.shape[1])[None, :] < lens[:, None]).long()
    # response token t of row i is predicted at position p_i - 1 + t
    seq = torch.repeat_interleave(torch.arange(len(rows)), torch.tensor(sizes))
    pos = torch.cat([torch.arange(len(s) - n - 1, len(s) - 1) for s, n in zip(seqs, sizes)])
    tgt = torch.cat([s[len(s) - n:] for s, n in zip(seqs, sizes)])
    with torch.inference_mode():
        st = position_stats(model, tgt.to(device), seq.to(device), pos.to(device), temperature, chunk, top_k=top_k,
                            input_ids=ids.to(device), attention_mask=attn.to(device))
    lp = st.logprobs.cpu().split(sizes)
    if not top_k:
        return [(x.tolist(), None, None) for x in lp]
    top_i, top_v = st.top_indices.cpu().split(sizes), st.top_values.cpu().split(sizes)
    return [(x.tolist(), i.tolist(), v.tolist()) for x, i, v in zip(lp, top_i, top_v)]


class TeacherScoring:
    inputs = ("data_source", "prompt_ids", "response_ids", "status", "error")
    outputs = ("teacher_id", "teacher_logprobs", "status", "error", "teacher_topk_ids", "teacher_topk_logprobs",
               "teacher_swaps", "teacher_swap_bytes", "teacher_swap_s")

    def __init__(self, cfg: TeacherConfig, student_dir: str, num_threads: int = 1):
        if num_threads:
            torch.set_num_threads(num_threads)
        self.cfg = cfg
        self.manager = TeacherManager(cfg, student_dir)
        self.pad_id = load_tokenizer(student_dir).pad_token_id

    def __call__(self, batch: pa.Table) -> pa.Table:
        rows = batch.select(list(self.inputs)).to_pylist()
        n = len(rows)
        out = {k: [None] * n for k in self.outputs} | {
            "status": [r["status"] for r in rows], "error": [r["error"] or "" for r in rows],
            "teacher_swaps": [0] * n, "teacher_swap_bytes": [0] * n, "teacher_swap_s": [0.0] * n}
        groups: dict[str, list[int]] = {}
        for i, r in enumerate(rows):
            if r["status"] in SKIP:
                continue
            try:
                groups.setdefault(self.cfg.route(r["data_source"]), []).append(i)
            except ValueError as e:
                self._fail(out, i, str(e))
        for tid in self.manager.order(groups):
            self._score_group(tid, groups[tid], rows, out)
        return self._table(batch, out)

    def _score_group(self, tid: str, idx: list[int], rows: list[dict], out: dict) -> None:
        try:
            model, swap = self.manager.acquire(tid)
        except Exception as e:  # noqa: BLE001 - a teacher that cannot load fails its rows, not the run
            for i in idx:
                self._fail(out, i, f"teacher {tid!r} could not be swapped in: {type(e).__name__}: {e}")
            return
        first = idx[0]
        out["teacher_swaps"][first], out["teacher_swap_bytes"][first] = swap.swaps_in, swap.bytes_in
        out["teacher_swap_s"][first] = swap.seconds
        for i in idx:
            out["teacher_id"][i], out["teacher_logprobs"][i] = tid, []   # empty responses stay empty
        for j in range(0, len(idx), mb := self.cfg.micro_batch):
            if chunk := [i for i in idx[j: j + mb] if rows[i]["response_ids"]]:
                self._score_chunk(tid, model, chunk, rows, out)

    def _score_chunk(self, tid, model, chunk: list[int], rows: list[dict], out: dict) -> None:
        try:
            results = list(zip(chunk, self._score(model, [rows[i] for i in chunk])))
        except Exception:  # noqa: BLE001 - find the row(s) at fault: score one by one
            results = []
            for i in chunk:
                try:
                    results.append((i, self._score(model, [rows[i]])[0]))
                except Exception as e:  # noqa: BLE001
                    self._fail(out, i, f"teacher {tid!r} failed on this row: {type(e).__name__}: {e}")
        for i, (lp, top_ids, top_lp) in results:
            out["teacher_logprobs"][i] = lp
            out["teacher_topk_ids"][i], out["teacher_topk_logprobs"][i] = top_ids, top_lp

    def _score(self, model, rows):
        return score_rows(model, rows, self.cfg.temperature, self.cfg.top_k, self.pad_id, self.manager.device,
                          self.cfg.logprob_chunk)

    @staticmethod
    def _fail(out: dict, i: int, error: str) -> None:
        out["status"][i], out["error"][i] = "failed", ERROR_PREFIX + error
        out["teacher_logprobs"][i] = out["teacher_topk_ids"][i] = out["teacher_topk_logprobs"][i] = None

    @staticmethod
    def _table(batch: pa.Table, out: dict) -> pa.Table:
        typed = {"teacher_swaps": pa.int32(), "teacher_swap_bytes": pa.int64(), "teacher_swap_s": pa.float64()}
        table = with_columns(batch, {k: v for k, v in out.items() if k not in typed})   # schema-typed columns
        for name, typ in typed.items():     # the stage's own accounting, not in the trajectory schema
            arr = pa.array(out[name], type=typ)
            idx = table.schema.get_field_index(name)
            table = table.set_column(idx, name, arr) if idx >= 0 else table.append_column(name, arr)
        return table


def teacher_metrics(table: pa.Table) -> dict:
    """Per-step teacher figures from the scored rows the trainer consumed (the controller logs them)."""
    if "teacher_swaps" not in table.column_names:
        return {}
    ids = table.column("teacher_id").to_pylist()
    errors = table.column("error").to_pylist()
    m = {"teacher/swaps": sum(table.column("teacher_swaps").to_pylist()),
         "teacher/swap_bytes": sum(table.column("teacher_swap_bytes").to_pylist()),
         "teacher/swap_s": sum(table.column("teacher_swap_s").to_pylist()),
         "teacher/scored": sum(lp is not None for lp in table.column("teacher_logprobs").to_pylist()),
         "teacher/failed": sum((e or "").startswith(ERROR_PREFIX) for e in errors)}
    for tid in sorted({t for t in ids if t is not None}):
        m[f"teacher/rows/{tid}"] = ids.count(tid)
    return m
