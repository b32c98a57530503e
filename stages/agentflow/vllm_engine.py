"""Production rollout engine: vLLM's engine in a Ray actor, behind the HFEngine method surface.

`rollout.engine: vllm`. Token ids in (`TokensPrompt`); token ids, the sampled token's log-prob
(vLLM's `processed_logprobs`: under logits / temperature, the distribution sampled from, as
the trainer computes it) and the weight version of every token out. vLLM batches the
requests in flight itself (continuous batching, paged KV cache, prefix cache).

Why vLLM's `LLMEngine` in this process (VLLM_ENABLE_V1_MULTIPROCESSING=0), stepped by a
thread of ours, rather than `AsyncLLM` or an engine core in its own process:
* weights land with no serialisation: the TransferMesh's Receiver in this actor verifies each
  bucket from the route it was sent over (shared memory on one host) and the views go straight
  to the worker's `reload_weights`; across processes vLLM's RPC turns tensors into lists;
* one thread owns the engine and calls `step()`: a version lands between two steps (the
  same lock), so every token a step returns was sampled under the version read in that hold
  of the lock: the per-token version is exact, not a span guessed from timing;
* killing the actor kills the engine: no orphaned engine-core process to clean up.
Generate calls from many rollout workers (the actor is threaded) only enqueue and wait.

The engine contract (stages/agentflow/engine_contract.py, which HFEngine and SGLangEngine serve
too): each row is one sample (the rollout stage sends a group's `n` samples as n rows: vLLM's
prefix cache shares their prompt). A row stops on the tokenizer's eos or its budget (clipped to
the context). A seeded row's sampler is seeded with seed + tokens already in its response, so a
resumed row is reproducible too.

Weights: `load_weights(named, version)` between steps: the worker's
`model_runner.reload_weights` (HF names; vLLM fuses q/k/v and gate/up itself), then the LM
head's prepacked weight is rebuilt (tied embeddings: vLLM 0.32's CPU reload leaves it on the
old embedding), then the prefix cache is reset. Rows in flight go on under the new weights
(partial rollout: their tokens carry both versions); `hold` rows keep one version: an update
waits for them. New rows of a version also get that version as their prefix-cache salt, so
a block cached under the old weights is never reused even where a reset cannot free it.

LoRA (trainer.lora on): a version is the adapter alone, written as a peft directory (tmpfs)
and served as LoRARequest v<version>; each row keeps the adapter it started with (its tokens
carry that version), and an adapter is removed once no row uses it and a newer one exists.
"""
from __future__ import annotations

import contextlib
import os
import shutil
import threading
import time
import uuid
from dataclasses import dataclass, field

import torch

from stages.agentflow.engine_config import VLLMConfig
from stages.agentflow.engine_contract import (
    STATUS,
    LibraryWeights,
    VersionGate,
    adapter_dir,
    fresh_stats,
    identity,
    published_specs,
    reconstructed,
    sampling_of,
    summarize_stats,
    wait_synced,
)
from stages.agentflow.limits import failed_row, model_limits, room, row_error
from stages.lora import LoraConfig, write_adapter
from stages.model import load_tokenizer

IDLE_WAIT_S = 0.5           # the step thread sleeps this long at most when there is nothing to do


@dataclass(eq=False)
class _Row:
    """One request in vLLM: what it has sampled so far, and the call waiting for it."""
    rid: str
    prompt: list[int]
    params: object                      # vllm.SamplingParams
    resp: list[int]
    lps: list[float]
    vers: list[int]
    hold: bool
    lora: tuple[str, int] | None        # (adapter name, version) it started with
    t_dispatch: float
    done: threading.Event = field(default_factory=threading.Event)
    status: str = ""
    error: str = ""                     # the engine failed under it: generate raises this
    started: bool = False               # it has had a token (queue wait counted)

    def finish(self, status: str) -> None:
        self.status = status
        self.done.set()

    def result(self) -> dict:
        return {"response_ids": self.resp, "logprobs": self.lps, "versions": self.vers, "status": self.status}


def _reload(worker, named: dict) -> None:
    """In the worker (this process): load a complete HF state dict into the running model."""
    worker.reload_weights(weights_iterator=iter(named.items()))
    model = worker.model_runner.get_model()
    head = getattr(model, "lm_head", None)
    method = getattr(head, "quant_method", None)
    if head is not None and method is not None and hasattr(method, "process_weights_after_loading"):
        method.process_weights_after_loading(head)   # the tied head's packed weight, from the new embedding


def check_lora(lora: LoraConfig) -> None:
    """ValueError naming the key when vLLM cannot serve trainer.lora's adapters as the trainer trains them."""
    if lora.target_regex:
        raise ValueError("trainer.lora.target_regex: rollout.engine=vllm reads adapters whose targets are module "
                         "names; use trainer.lora.target_modules")
    if lora.modules_to_save:
        raise ValueError("trainer.lora.modules_to_save: rollout.engine=vllm serves LoRA adapters only (no module "
                         "trained in full beside them); leave it empty")


class VLLMEngine(LibraryWeights):
    """HFEngine's surface over vLLM's LLMEngine. A threaded Ray actor (max_concurrency > 1);
    the first five arguments are HFEngine's, so the controller builds either the same way."""

    def __init__(self, model_path: str, dtype: str = "float32", seed: int = 0, num_threads: int = 1,
                 engine_id: str = "engine0", cfg: VLLMConfig | None = None, lora: LoraConfig | None = None):
        cfg = cfg or VLLMConfig()
        self.engine_id, self.model_path, self.dtype, self.cfg = engine_id, model_path, dtype, cfg
        self.lora = lora if lora is not None and lora.enabled else None
        if self.lora is not None:
            check_lora(self.lora)
        self.tok = load_tokenizer(model_path)
        self.eos_id = self.tok.eos_token_id
        self.context, self.vocab = model_limits(model_path)
        self.vocab = self.vocab or len(self.tok)
        self.threads = max(1, num_threads)
        self.engine = self._build(seed)
        self.version = 0
        self.incarnation = uuid.uuid4().hex      # new in every process: a changed one means restarted
        self.mesh_endpoint = None
        self._specs = published_specs(model_path, dtype, self.lora)
        self._adapter: tuple[str, int] | None = None      # (name, version) new rows start with
        self._adapters_loaded: dict[str, int] = {}          # name -> lora_int_id, resident in vLLM
        if self.lora is not None:
            self._lora_dir = adapter_dir(engine_id)
        self._lock = threading.Lock()            # engine calls: a step, an update, an abort
        self._wake = threading.Condition()       # guards _pending, _rows
        self._gate = VersionGate()               # hold calls against updates
        self._pending: list[_Row] = []
        self._rows: dict[str, _Row] = {}         # in vLLM
        self._abort_before = -1.0
        self._closed = False
        self._next_id = 0
        self.stats = fresh_stats()
        self._synced = threading.Event()
        self._synced.set()
        if reconstructed():    # a restarted engine holds the initial weights: it waits for the current version
            self._synced.clear()
        self._thread = threading.Thread(target=self._loop, name=f"{engine_id}-vllm-step", daemon=True)
        self._thread.start()

    def _build(self, seed: int):
        """vLLM's LLMEngine, in this process (see the module docstring)."""
        os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
        os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "nobind")     # a shared machine: no core pinning
        os.environ.setdefault("VLLM_CPU_NUM_OF_RESERVED_CPU", "0")
        os.environ["OMP_NUM_THREADS"] = str(self.threads)    # else vLLM drops torch to 1 thread for serving
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
        engine = LLMEngine.from_engine_args(EngineArgs(**args))
        self._warm_up(engine)
        return engine

    def _warm_up(self, engine) -> None:
        """A small batch through the engine at start: its first steps build kernels and buffers for new
        shapes (seconds on CPU), which the first rollout would wait for otherwise."""
        from vllm import SamplingParams

        for i in range(16):
            engine.add_request(f"warm-up-{i}", {"prompt_token_ids": [self.eos_id] * (1 + i % 4)},
                               SamplingParams(max_tokens=4, ignore_eos=True))
        while engine.has_unfinished_requests():
            engine.step()

    # ---- identity / weights --------------------------------------------------------
    def info(self) -> dict:
        return identity(self, threads=self.threads, engine="vllm")

    def load_weights(self, named_tensors: dict, version: int) -> None:
        """Apply one complete version between two steps (the tensors are the Receiver's verified
        views: reload_weights copies them into vLLM's own, fused, parameters)."""
        if self.lora is not None:
            return self._load_adapter(named_tensors, version)
        with self._exclusive():
            if named_tensors:       # empty: only the clock (a resumed run)
                self.engine.collective_rpc(_reload, args=(named_tensors,))
                self.engine.reset_prefix_cache()
            self.version = int(version)
        self._synced.set()

    def _load_adapter(self, named: dict, version: int) -> None:
        """A LoRA version: adapter v<version>, used by rows that start from now on."""
        if named:
            from vllm.lora.request import LoRARequest

            name = f"v{int(version)}"
            path = write_adapter(named, self.lora, self.model_path, os.path.join(self._lora_dir, name))
            with self._lock:
                self.engine.add_lora(LoRARequest(name, int(version) + 1, str(path)))
                self._adapters_loaded[name] = int(version) + 1
        with self._wake:
            self._adapter = (f"v{int(version)}", int(version)) if (named or self._adapter) else None
            self.version = int(version)
        self._release_adapters()
        self._synced.set()

    def _release_adapters(self) -> None:
        """Remove adapters that are not current and that no row in flight uses."""
        with self._wake:
            used = {r.lora[0] for r in list(self._rows.values()) + self._pending if r.lora}
            current = self._adapter[0] if self._adapter else None
            free = [n for n in self._adapters_loaded if n != current and n not in used]
        for name in free:
            with self._lock:
                self.engine.remove_lora(self._adapters_loaded.pop(name))
            shutil.rmtree(os.path.join(self._lora_dir, name), ignore_errors=True)

    @contextlib.contextmanager
    def _exclusive(self):
        """A version lands whole: after the hold rows in flight, between two steps."""
        with self._gate.updating(), self._lock:
            yield

    def abort_all(self) -> None:
        """Abort every request in flight now (used when a run stops or a window is closed)."""
        with self._wake:
            self._abort_before = time.time()
            self._wake.notify_all()

    def close(self) -> None:
        with self._wake:
            self._closed = True
            self._wake.notify_all()
        self._thread.join(timeout=10)
        if getattr(self, "_lora_dir", None):
            shutil.rmtree(self._lora_dir, ignore_errors=True)

    def pop_stats(self) -> dict:
        """As HFEngine's: requests, tokens, busy_s, decode_steps (engine steps), running_rows_mean/max
        (rows that got a token per step), queue_wait_s_mean/max (generate call -> first token)."""
        with self._wake:
            st, self.stats = self.stats, fresh_stats()
        return summarize_stats(st)

    # ---- generation ----------------------------------------------------------------
    def generate(self, requests: list[dict]) -> list[dict]:
        """See the module docstring. Returns per request: response_ids, logprobs, versions, status
        (completed|truncated|aborted|failed); a refused row has `error` and `code`, the others are served."""
        if not requests:
            return []
        wait_synced(self._synced, self.engine_id)
        from vllm.exceptions import VLLMValidationError

        t0 = time.time()
        out: list[dict] = [{}] * len(requests)
        rows: list[tuple[int, _Row]] = []
        hold = any(isinstance(r, dict) and r.get("hold") for r in requests)
        for i, r in enumerate(requests):
            refused = row_error(r, self.context, self.vocab)
            if refused:
                out[i] = failed_row(*refused)
                continue
            try:
                row = self._row(r, t0, hold)
            except (ValueError, VLLMValidationError) as e:  # a setting vLLM refuses (temperature > 2): this row fails
                out[i] = failed_row("invalid_request", f"vLLM refused the request: {e}")
                continue
            if row.status:
                out[i] = row.result()
            else:
                rows.append((i, row))
        if rows:
            self._submit([row for _, row in rows], hold)
            for i, row in rows:
                row.done.wait()
                if row.error:
                    raise RuntimeError(row.error)
                out[i] = row.result()
        with self._wake:
            self.stats["requests"] += len(requests)
            self.stats["tokens"] += sum(len(o["response_ids"]) for o in out)
        return out

    def _row(self, r: dict, t0: float, hold: bool) -> _Row:
        from vllm import SamplingParams
        from vllm.sampling_params import RequestOutputKind

        prefix = list(r.get("prefix_ids", []))
        budget = room(r, self.context)
        s = sampling_of(r)
        params = SamplingParams(max_tokens=max(budget, 1), temperature=s.temperature, top_p=s.top_p, seed=s.seed,
                                logprobs=0,
                                ignore_eos=True, stop_token_ids=[self.eos_id], detokenize=False,
                                skip_special_tokens=False, output_kind=RequestOutputKind.DELTA)
        with self._wake:
            self._next_id += 1
            rid = f"{self.engine_id}-{self._next_id}"
        row = _Row(rid, list(r["prompt_ids"]) + prefix, params, prefix, list(r.get("prefix_logprobs", [])),
                   list(r.get("prefix_versions", [])), hold, None, t0)
        if prefix and prefix[-1] == self.eos_id:
            row.finish("completed")
        elif budget <= 0:
            row.finish("truncated")
        return row

    def _submit(self, rows: list[_Row], hold: bool) -> None:
        """Queue rows for the step thread; hold rows wait for an update in progress, then keep it out."""
        if hold:
            self._gate.hold()
        with self._wake:
            for row in rows:
                row.lora = self._adapter
            self._pending.extend(rows)
            self._wake.notify_all()
        if hold:
            threading.Thread(target=self._unhold, args=(rows,), daemon=True).start()

    def _unhold(self, rows: list[_Row]) -> None:
        for row in rows:
            row.done.wait()
        self._gate.unhold()

    # ---- the step thread -----------------------------------------------------------
    def _loop(self) -> None:
        # OpenMP's thread count is per native thread: vLLM's CPU attention sizes its plan in this thread and
        # fails ("thread_num == thread_num") if it differs from the count its kernels run with. torch's own
        # setter: vLLM's CPU worker replaces torch.set_num_threads with a no-op once it has started
        torch._C.set_num_threads(self.threads)
        while True:
            with self._wake:
                self._wake.wait_for(lambda: self._closed or self._pending or self._rows, timeout=IDLE_WAIT_S)
                if self._closed:
                    break
                new, self._pending = self._pending, []
                aborted = [r for r in list(self._rows.values()) + new if r.t_dispatch < self._abort_before]
                self._rows.update({r.rid: r for r in new})
            if not self._rows:
                continue
            try:
                self._iteration(new, aborted)
            except Exception as e:  # noqa: BLE001 - the rows in hand fail with the engine's error; the thread goes on
                self._fail_all(e)
        self._fail_all(RuntimeError(f"{self.engine_id} closed"))

    def _iteration(self, new: list[_Row], aborted: list[_Row]) -> None:
        """Admit, abort, one engine step under the weight lock; hand each row its new tokens."""
        t = time.time()
        with self._lock:
            for row in new:
                self.engine.add_request(row.rid, self._prompt(row), row.params, lora_request=self._lora_request(row))
            if aborted:
                self.engine.abort_request([r.rid for r in aborted])
            outputs = self.engine.step() if self.engine.has_unfinished_requests() else []
            version = self.version
        for row in aborted:
            self._retire(row, "aborted")
        produced = 0
        for o in outputs:
            row = self._rows.get(o.request_id)
            if row is None:
                continue
            produced += self._append(row, o, version)
        with self._wake:
            self.stats["busy_s"] += time.time() - t
            if produced:
                self.stats["decode_steps"] += 1
                self.stats["_rows_sum"] += produced
                self.stats["running_rows_max"] = max(self.stats["running_rows_max"], produced)

    def _prompt(self, row: _Row) -> dict:
        # the version salts the prefix cache: a block computed under other weights is never reused
        salt = f"v{row.lora[1] if row.lora else self.version}"
        return {"prompt_token_ids": row.prompt, "cache_salt": salt}

    def _lora_request(self, row: _Row):
        if row.lora is None:
            return None
        from vllm.lora.request import LoRARequest

        name, version = row.lora
        return LoRARequest(name, version + 1, os.path.join(self._lora_dir, name))

    def _append(self, row: _Row, o, version: int) -> int:
        """One step's output of a row (DELTA: its new tokens only). Returns 1 if it got a token."""
        c = o.outputs[0]
        ids = list(c.token_ids)
        if row.lora is not None:
            version = row.lora[1]           # a LoRA row is served by the adapter it started with
        if ids and not row.started:
            row.started = True
            with self._wake:
                wait = time.time() - row.t_dispatch
                self.stats["_wait_sum"] += wait
                self.stats["_waited"] += 1
                self.stats["queue_wait_s_max"] = max(self.stats["queue_wait_s_max"], wait)
        row.resp += ids
        row.lps += [float(lp[t].logprob) for t, lp in zip(ids, c.logprobs or [])]
        row.vers += [version] * len(ids)
        if o.finished:
            self._retire(row, STATUS.get(c.finish_reason or "abort", "aborted"))
        return int(bool(ids))

    def _retire(self, row: _Row, status: str) -> None:
        with self._wake:
            self._rows.pop(row.rid, None)
        if not row.done.is_set():
            row.finish(status)
        if self.lora is not None and row.lora is not None:
            self._release_adapters()

    def _fail_all(self, error: Exception) -> None:
        with self._wake:
            rows, self._rows = list(self._rows.values()) + self._pending, {}
            self._pending = []
        for row in rows:
            if not row.done.is_set():
                row.error = f"{self.engine_id}: vLLM failed: {error!r}"
                row.finish("failed")

