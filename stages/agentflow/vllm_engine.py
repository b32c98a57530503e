"""Production rollout engine: vLLM's engine in a Ray actor, behind the engine contract (engine_contract.py).

`engine.kind: vllm`. Log-probs are vLLM's `processed_logprobs` (under logits / temperature, as the trainer
computes them). vLLM batches the requests in flight itself (continuous batching, paged KV cache, prefix
cache: a group's n rows share their prompt's blocks).

vLLM's `LLMEngine` in this process (VLLM_ENABLE_V1_MULTIPROCESSING=0), stepped by a thread of ours,
rather than `AsyncLLM` or an engine core in its own process:
* weights land with no serialisation: the TransferMesh's Receiver in this actor verifies each bucket
  and the views go straight to the worker's `reload_weights` (across processes vLLM's RPC turns
  tensors into lists);
* one thread owns the engine and calls `step()`: a version lands between two steps (the same lock),
  so the version read in that hold of the lock is exact for every token the step returns;
* killing the actor kills the engine: no orphaned engine-core process.
Generate calls (the actor is threaded) only enqueue and wait.

Weights: `load_weights` between steps (reload_weights in transfer/compat/vllm_api.py), then the prefix
cache is reset; new rows also get the version as their prefix-cache salt, so a block cached under older
weights is never reused even where a reset cannot free it. LoRA (trainer.lora on): a version is the adapter
alone, served as LoRARequest v<version> (AdapterSlots); each row keeps the adapter it started with.
"""
from __future__ import annotations

import contextlib
import itertools
import threading
import time
from concurrent.futures import Future
from dataclasses import dataclass, field

import torch

from stages.agentflow.engine_config import VLLMConfig
from stages.agentflow.engine_contract import STATUS, EngineBase
from stages.agentflow.limits import failed_row
from stages.agentflow.sampling import sampling_of
from stages.lora import LoraConfig
from transfer.compat.torch_api import set_native_threads
from transfer.compat.vllm_api import in_process_env, reload_weights, salted_prompt


@dataclass(eq=False)
class _Row:
    """One request in vLLM: what it has sampled so far, and the call waiting for it."""
    rid: str
    prompt: list[int]
    params: object                      # vllm.SamplingParams
    resp: list[int]
    lps: list[float]
    vers: list[int]
    t_dispatch: float
    lora: int | None = None             # the adapter version it started with
    done: Future = field(default_factory=Future)    # its result, or the engine's failure under it
    started: bool = False               # it has had a token (queue wait counted)


def check_lora(lora: LoraConfig) -> None:
    """ValueError naming the key when vLLM cannot serve trainer.lora's adapters as the trainer trains them."""
    if lora.target_regex:
        raise ValueError("trainer.lora.target_regex: engine.kind=vllm reads adapters whose targets are module "
                         "names; use trainer.lora.target_modules")
    if lora.modules_to_save:
        raise ValueError("trainer.lora.modules_to_save: engine.kind=vllm serves LoRA adapters only (no module "
                         "trained in full beside them); leave it empty")


class VLLMEngine(EngineBase):
    """A threaded Ray actor (max_concurrency > 1)."""

    def __init__(self, model_path: str, dtype: str = "float32", seed: int = 0, num_threads: int = 1,
                 engine_id: str = "engine0", cfg: VLLMConfig | None = None, lora: LoraConfig | None = None):
        if lora is not None and lora.enabled:
            check_lora(lora)
        self._start_library(model_path, dtype, engine_id, cfg or VLLMConfig(), lora)
        self.threads = max(1, num_threads)
        self.about = {"threads": self.threads, "engine": "vllm"}
        self.engine = self._build(seed)
        self._lock = threading.Lock()            # engine calls: a step, an update, an abort
        self._wake = threading.Condition()       # guards _pending, _rows
        self._pending: list[_Row] = []
        self._rows: dict[str, _Row] = {}         # in vLLM
        self._abort_before = -1.0
        self._ids = itertools.count(1)
        threading.Thread(target=self._loop, name=f"{engine_id}-vllm-step", daemon=True).start()

    def _build(self, seed: int):
        in_process_env(self.threads)
        torch.set_num_threads(self.threads)
        from vllm import EngineArgs, LLMEngine

        c = self.cfg
        args = dict(model=self.model_path, dtype=self.dtype, seed=seed, enforce_eager=c.enforce_eager,
                    kv_cache_memory_bytes=c.kv_cache_mb << 20, max_num_seqs=c.max_num_seqs,
                    max_num_batched_tokens=max(c.max_num_batched_tokens, self.context or 0),
                    enable_prefix_caching=c.prefix_caching, logprobs_mode="processed_logprobs",
                    disable_log_stats=True)
        if self.context:
            args["max_model_len"] = self.context
        if self.lora is not None:
            args |= dict(enable_lora=True, max_lora_rank=self.lora.rank, max_loras=c.max_loras)
        args |= dict(c.engine_args)
        return LLMEngine.from_engine_args(EngineArgs(**args))

    # ---- weights ------------------------------------------------------------------
    def load_weights(self, named_tensors: dict, version: int) -> None:
        """Apply one complete version between two steps, after the hold rows in flight."""
        if self.lora is not None:
            return self._load_adapter(named_tensors, version)
        with self._gate.updating(), self._lock:
            if named_tensors:       # empty: only the clock (a resumed run)
                reload_weights(self.engine, named_tensors)
                self.engine.reset_prefix_cache()
            self._landed(version)

    def _lora_request(self, version: int):
        from vllm.lora.request import LoRARequest

        return LoRARequest(f"v{version}", version + 1, self._slots.path(version))

    def _add_adapter(self, version: int) -> None:
        with self._lock:
            self.engine.add_lora(self._lora_request(version))

    def _remove_adapter(self, version: int) -> None:
        with self._lock:
            self.engine.remove_lora(version + 1)

    def abort_all(self) -> None:
        with self._wake:
            self._abort_before = time.time()
            self._wake.notify_all()

    # ---- generation ----------------------------------------------------------------
    def generate(self, requests: list[dict]) -> list[dict]:
        """The contract's generate (engine_contract.py); a setting vLLM refuses (temperature > 2) fails its row."""
        from vllm.exceptions import VLLMValidationError

        out, todo = self._plan(requests)
        t0 = time.time()
        rows: list[tuple[int, _Row]] = []
        for i, r, budget in todo:
            try:
                rows.append((i, self._row(r, budget, t0)))
            except (ValueError, VLLMValidationError) as e:
                out[i] = failed_row("invalid_request", f"vLLM refused the request: {e}")
        with self._gate.holding(any(r.get("hold") for _, r, _ in todo)):
            with self._wake:
                for _, row in rows:
                    row.lora = self._slots.bind() if self._slots is not None else None
                self._pending.extend(row for _, row in rows)
                self._wake.notify_all()
            for i, row in rows:
                out[i] = row.done.result()
        return self._served(out)

    def _row(self, r: dict, budget: int, t0: float) -> _Row:
        from vllm import SamplingParams
        from vllm.sampling_params import RequestOutputKind

        s = sampling_of(r)
        params = SamplingParams(max_tokens=budget, temperature=s.temperature, top_p=s.top_p, seed=s.seed,
                                logprobs=0, ignore_eos=True, stop_token_ids=[self.eos_id], detokenize=False,
                                skip_special_tokens=False, output_kind=RequestOutputKind.DELTA)
        prefix = list(r.get("prefix_ids", []))
        return _Row(f"{self.engine_id}-{next(self._ids)}", list(r["prompt_ids"]) + prefix, params, prefix,
                    list(r.get("prefix_logprobs", [])), list(r.get("prefix_versions", [])), t0)

    # ---- the step thread -----------------------------------------------------------
    def _loop(self) -> None:
        # OpenMP's thread count is per native thread: vLLM's CPU attention sizes its plan in this thread and
        # fails ("thread_num == thread_num") if it differs from the count its kernels run with. torch's own
        # setter: vLLM's CPU worker replaces torch.set_num_threads with a no-op once it has started
        set_native_threads(self.threads)
        while True:
            with self._wake:
                self._wake.wait_for(lambda: self._pending or self._rows)
                new, self._pending = self._pending, []
                aborted = [r for r in list(self._rows.values()) + new if r.t_dispatch < self._abort_before]
                self._rows.update({r.rid: r for r in new})
            if not self._rows:
                continue
            try:
                self._iteration(new, aborted)
            except Exception as e:  # noqa: BLE001 - the rows in hand fail with the engine's error; the thread goes on
                self._fail_all(e)

    def _iteration(self, new: list[_Row], aborted: list[_Row]) -> None:
        """Admit, abort, one engine step under the weight lock; hand each row its new tokens."""
        t = time.time()
        with self._lock:
            for row in new:
                lora = self._lora_request(row.lora) if row.lora is not None else None
                salt = f"v{row.lora if row.lora is not None else self.version}"
                self.engine.add_request(row.rid, salted_prompt(row.prompt, salt), row.params, lora_request=lora)
            if aborted:
                self.engine.abort_request([r.rid for r in aborted])
            outputs = self.engine.step() if self.engine.has_unfinished_requests() else []
            version = self.version
        for row in aborted:
            self._retire(row, "aborted")
        produced = 0
        for o in outputs:
            row = self._rows.get(o.request_id)
            if row is not None:
                produced += self._append(row, o, version)
        self._count(busy_s=time.time() - t)
        if produced:
            self._count_step(produced)

    def _append(self, row: _Row, o, version: int) -> int:
        """One step's output of a row (DELTA: its new tokens only). Returns 1 if it got a token."""
        c = o.outputs[0]
        ids = list(c.token_ids)
        if ids and not row.started:
            row.started = True
            self._count_waits([time.time() - row.t_dispatch])
        row.resp += ids
        row.lps += [float(lp[t].logprob) for t, lp in zip(ids, c.logprobs or [])]
        row.vers += [version if row.lora is None else row.lora] * len(ids)   # a LoRA row: its adapter's version
        if o.finished:
            self._retire(row, STATUS.get(c.finish_reason or "abort", "aborted"))
        return int(bool(ids))

    def _retire(self, row: _Row, status: str, error: Exception | None = None) -> None:
        with self._wake:
            self._rows.pop(row.rid, None)
        if not row.done.done():
            if error is not None:
                row.done.set_exception(error)
            else:
                row.done.set_result({"response_ids": row.resp, "logprobs": row.lps, "versions": row.vers,
                                     "status": status})
            if self._slots is not None:
                self._unload(self._slots.unbind(row.lora))

    def _fail_all(self, error: Exception) -> None:
        with self._wake:
            rows, self._rows, self._pending = [*self._rows.values(), *self._pending], {}, []
        for row in rows:
            with contextlib.suppress(Exception):    # a failed engine may not remove the row's adapter
                self._retire(row, "failed", RuntimeError(f"{self.engine_id}: vLLM failed: {error!r}"))
