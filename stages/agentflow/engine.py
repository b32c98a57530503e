"""Embedded rollout engine: an HF causal LM in a Ray actor, token ids in, token ids out.

Why our own decode loop instead of `model.generate`: we need, per token, the sampled id,
its log-probability under exactly the distribution sampled from (logits / temperature),
and the weight version that produced it. Weight updates take the same lock as a decode
step, so a step never sees half-loaded weights, and a sequence that spans an update
records both versions (partial rollout) unless the request asks to hold the lock.

With trainer.lora on, a version is the adapter alone: it lands in the engine's adapter
buffers under the same lock, then is merged into the weights from a kept base copy
(serve=merge) or served by peft's layers (serve=peft); see stages/lora.py.

Continuous batching (batching="continuous", the default): one decode thread owns a running
batch. `generate` enqueues its rows and waits for them; between two decode steps the thread
admits waiting rows (their prefill, shared by rows of one context, then their KV cache merged
into the batch's, left-padded) and retires finished ones, so a short turn joins the batch that
a long generation is in and leaves it when done, instead of waiting behind it. A step is one
forward under the weight lock, so updates land between steps as before. Rows that `hold` a
version are served by the static loop (batching="static": one loop per call and sampling
setting), which keeps the lock for the whole call: holding it while any hold row runs in a
shared batch would let a stream of hold rows starve weight updates.

Memory follows the response, not vocabulary x prompt. A forward computes the LM head only at
the last position (HF's `logits_to_keep`): a prefill of an 18.8k-token prompt on Qwen's
151,669-token vocabulary would otherwise make an 11 GB fp32 logits tensor to read one row of
it. No caller asks for prompt log-probs (the OpenAI `echo` is refused), so none are computed.
The KV cache is the engine's memory, `kv_cache_mb` (rollout.kv_cache_mb): the running batch's
cache is rows x its widest row (left-padded), and rows are admitted while that, at every row's
longest (context + remaining budget), stays within it; a request that cannot fit alone fails
with an error naming its tokens, the limit and the key (status `failed`, code
context_length_exceeded, so a harness can compact), and the other rows are served.
Rows of different lengths prefilled together are left-padded, and padding makes attention take
an explicit mask of rows x width^2 (2 rows of 19k tokens: 3.5 GB, and 7x slower than without);
so rows are prefilled in packs whose mask stays small, and a long context alone, where no mask
is built at all.
"""
from __future__ import annotations

import contextlib
import inspect
import threading
import time
import uuid
from collections import deque
from concurrent.futures import Future
from dataclasses import dataclass, field

import numpy as np
import torch

from stages.agentflow.engine_contract import (
    RESYNC_TIMEOUT_S,
    fresh_stats,
    identity,
    mesh_call,
    reconstructed,
    summarize_stats,
    wait_synced,
)
from stages.agentflow.limits import failed_row, room, row_error
from stages.lora import SERVERS, LoraConfig
from stages.model import load_model, load_tokenizer
from stages.priority import lower_priority

CALIBRATE_MAX_PARAMS = 50_000_000   # larger models are matmul-bound: they keep every thread they are given
CALIBRATE_ROUNDS = 5                 # timings per thread setting; the best of each is compared
CALIBRATE_MARGIN = 0.9               # more threads are kept only when at least 10% faster
CDF_CELLS = 2 ** 21                  # sampling's rows at a time: rows x vocabulary cells (a float64 CDF: 16 MB)
BATCHING = ("continuous", "static")
IDLE_EXIT_S = 1.0                    # the decode thread ends after this long with nothing to do (restarted on demand)
KV_CACHE_MB = 1024.0                 # default rollout.kv_cache_mb
PREFILL_MASK_ELEMS = 2 ** 24         # a padded prefill's attention mask (distinct contexts x width^2) at most


@dataclass(eq=False)
class _Row:
    """One request in the continuous batch: its whole context, what it has sampled, what it may still sample."""
    seq: list[int]              # prompt + response so far (the response's last token is not in the cache yet)
    resp: list[int]             # prefix + sampled
    lps: list[float]
    vers: list[int]
    budget: int                 # tokens it may still sample
    seed: int | None
    temp: float
    top_p: float
    t_dispatch: float           # its generate call's start: abort_all aborts calls started before it
    t_queued: float = field(default_factory=time.perf_counter)
    done: Future = field(default_factory=Future)

    def finish(self, status: str) -> None:
        self.done.set_result({"response_ids": self.resp, "logprobs": self.lps, "versions": self.vers,
                              "status": status})

    @property
    def need(self) -> int:
        """KV cache columns it may come to hold: its context now and all it may still sample."""
        return len(self.seq) + self.budget


def _kv(cache) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """(keys, values) per layer, [batch, heads, length, head_dim]: transformers >= 4.56 keeps one
    object per layer (`layers[i].keys`), older versions two lists (`key_cache`, `value_cache`)."""
    if hasattr(cache, "layers"):
        return [(layer.keys, layer.values) for layer in cache.layers]
    return list(zip(cache.key_cache, cache.value_cache))


def _set_kv(cache, kv: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
    if hasattr(cache, "layers"):
        for layer, (k, v) in zip(cache.layers, kv):
            layer.keys, layer.values = k, v
    else:
        cache.key_cache[:], cache.value_cache[:] = [k for k, _ in kv], [v for _, v in kv]


@dataclass
class _Batch:
    """The running rows' KV cache, left-padded: `mask` marks real cache columns per row; `pos` is the
    position id of each row's next token, `last` that token (sampled, not yet in the cache)."""
    cache: object
    mask: torch.Tensor          # [rows, columns] long
    pos: torch.Tensor           # [rows] long
    last: torch.Tensor | None = None

    def select(self, keep: list[int]) -> "_Batch":
        """The rows in `keep` (their cache gathered); columns that are padding in every kept row are dropped."""
        idx = torch.tensor(keep)
        mask = self.mask[idx]
        lead = int((mask.sum(0) == 0).long().cumprod(0).sum())       # all-padding columns on the left
        _set_kv(self.cache, [(k[idx, :, lead:], v[idx, :, lead:]) for k, v in _kv(self.cache)])
        return _Batch(self.cache, mask[:, lead:], self.pos[idx], self.last[idx])

    @staticmethod
    def concat(a: "_Batch", b: "_Batch") -> "_Batch":
        """b's rows after a's, both right-aligned on the newest column (the shorter padded on the left)."""
        width = max(a.mask.shape[1], b.mask.shape[1])

        def pad(t, n):      # n zero columns before t's on the sequence axis (dim 2 of kv, 1 of the mask)
            if n == 0:
                return t
            dim = 2 if t.dim() == 4 else 1
            shape = list(t.shape)
            shape[dim] = n
            return torch.cat([t.new_zeros(shape), t], dim=dim)

        pa, pb = width - a.mask.shape[1], width - b.mask.shape[1]
        _set_kv(a.cache, [(torch.cat([pad(ka, pa), pad(kb, pb)]), torch.cat([pad(va, pa), pad(vb, pb)]))
                          for (ka, va), (kb, vb) in zip(_kv(a.cache), _kv(b.cache))])
        return _Batch(a.cache, torch.cat([pad(a.mask, pa), pad(b.mask, pb)]), torch.cat([a.pos, b.pos]))


class HFEngine:
    """Batched sampling with a KV cache. Runs as a threaded Ray actor (max_concurrency > 1)."""

    def __init__(self, model_path: str, dtype: str = "float32", seed: int = 0, num_threads: int = 1,
                 engine_id: str = "engine0", nice: int = 0, lora: LoraConfig | None = None,
                 batching: str = "continuous", max_running_rows: int = 256, kv_cache_mb: float = KV_CACHE_MB,
                 special_ids: tuple[int, int] | None = None):
        """special_ids: (eos, pad) of the model's tokenizer, from a process that loaded it (the driver):
        they are all generation needs of it, and a 151k-token tokenizer costs ~200 MB to load, ~45 MB
        to hold. Without them the engine loads the tokenizer itself (`self.tok`)."""
        if batching not in BATCHING:
            raise ValueError(f"rollout.engine_batching must be continuous or static, got {batching!r}")
        if max_running_rows < 1:
            raise ValueError(f"max_running_rows (rollout.engine_max_rows) must be >= 1, got {max_running_rows}")
        if not kv_cache_mb > 0:
            raise ValueError(f"kv_cache_mb (rollout.kv_cache_mb) must be > 0, got {kv_cache_mb}")
        lower_priority(nice)
        torch.set_num_threads(num_threads)
        self.engine_id = engine_id
        self.model = load_model(model_path, dtype)
        # transformers 5.x renamed past_key_values -> cache; support both spellings (asked of the HF model:
        # a peft wrapper's forward takes **kwargs)
        params = inspect.signature(self.model.forward).parameters
        self._cache_kw = "cache" if "cache" in params else "past_key_values"
        # the LM head at the last position only; a model without the argument computes it everywhere
        self._last_only = {"logits_to_keep": 1} if "logits_to_keep" in params else {}
        # LoRA: versions are adapters, applied to this base (which never changes)
        self.adapter = SERVERS[lora.serve](self.model, lora) if lora is not None and lora.enabled else None
        if self.adapter is not None:
            self.model = self.adapter.model
        if special_ids is None:
            self.tok = load_tokenizer(model_path)
            special_ids = (self.tok.eos_token_id, self.tok.pad_token_id)
        self.eos_id, self.pad_id = special_ids
        # a row over the context fails alone; every row's budget is clipped to the room it leaves
        text_cfg = self.model.config.get_text_config()
        self.context = int(getattr(text_cfg, "max_position_embeddings", 0) or 0)
        self.vocab = self.model.get_input_embeddings().num_embeddings
        self.version = 0
        self._lock = threading.Lock()
        self._gen = torch.Generator().manual_seed(seed)
        self._abort_before = -1.0           # requests dispatched before this time are aborted
        self.mesh_endpoint = None
        self.batching = batching
        self.max_running_rows = max_running_rows        # rows in the running batch at once; more wait
        self.kv_cache_mb = kv_cache_mb
        self.kv_token_bytes = self._kv_token_bytes()
        self.kv_cache_tokens = int(kv_cache_mb * 2 ** 20 // self.kv_token_bytes)   # cache columns x rows, at most
        self._waiting: deque[_Row] = deque()            # rows enqueued by generate, not yet admitted
        self._wake = threading.Condition()              # guards _waiting and _scheduling
        self._scheduling = False                        # the decode thread is running
        self._stats_lock = threading.Lock()
        self.stats = fresh_stats()
        self._synced = threading.Event()
        self._synced.set()
        self.threads = self._pick_threads(num_threads)
        torch.set_num_threads(self.threads)
        self.stats = fresh_stats()         # the calibration's steps are not served work
        # A restarted engine (Ray re-ran this constructor after the process died) holds the
        # initial weights: it serves nothing until the controller has re-sent the current version.
        # `incarnation` is new in every process: the controller counts a restart only when it changes.
        self.incarnation = uuid.uuid4().hex
        self._awaiting_resend = reconstructed()
        if self._awaiting_resend:
            self._synced.clear()

    def _kv_token_bytes(self) -> int:
        """Bytes of KV cache one token takes in this model (every layer's keys and values), measured
        on a one-token forward rather than read from config fields that differ by architecture."""
        with torch.no_grad():
            o = self.model(input_ids=torch.zeros((1, 1), dtype=torch.long), use_cache=True, **self._last_only)
        return max(1, sum(t.numel() * t.element_size() for kv in _kv(o[self._cache_kw]) for t in kv))

    def _pick_threads(self, most: int) -> int:
        """`most` threads, or 1 where that generates faster: a small model's decode step is a
        few tiny matmuls, and splitting them costs more than it saves (quickstart: 64 rows in
        17 ms on 1 thread, 21 ms on 2). Timed once at start, on a batch shaped like a rollout
        unit (8 prompts x 8 samples), the two settings interleaved, best of CALIBRATE_ROUNDS each;
        a large model keeps `most` untimed."""
        if most <= 1 or sum(p.numel() for p in self.model.parameters()) > CALIBRATE_MAX_PARAMS:
            return max(1, most)
        g = torch.Generator().manual_seed(0)
        prompts = torch.randint(0, self.model.config.vocab_size, (8, 6), generator=g).tolist()
        reqs = [{"prompt_ids": p, "seed": k} for p in prompts for k in range(8)]

        best = {1: float("inf"), most: float("inf")}
        for _ in range(CALIBRATE_ROUNDS):     # interleaved: a burst of load at start-up hits both alike
            for threads in best:
                torch.set_num_threads(threads)
                t = time.perf_counter()
                self._decode(reqs, 6, 1.0, 1.0, False, time.time())
                best[threads] = min(best[threads], time.perf_counter() - t)
        # more threads must win clearly: one thread leaves the other cores to the rest of the pipeline
        return most if best[most] < CALIBRATE_MARGIN * best[1] else 1

    # ---- identity / weights --------------------------------------------------------
    def info(self) -> dict:
        return identity(self, threads=self.threads, engine="hf")

    def weight_version(self) -> int:
        return self.version

    def needs_sync(self) -> bool:
        """True on a restarted engine until its first complete weight load. Not the serving flag:
        that one is also clear while an ordinary version lands in place (weights_in_place)."""
        return self._awaiting_resend

    def _landing(self) -> dict:
        """The tensors a version is written into: the model's, or the adapter's buffers."""
        return self.model.state_dict() if self.adapter is None else self.adapter.buffers

    def weight_specs(self) -> dict:
        return {n: (tuple(t.shape), t.dtype) for n, t in self._landing().items()}

    def load_weights(self, named_tensors: dict, version: int) -> None:
        """Apply one complete version atomically (between decode steps)."""
        with self._lock:
            if self.adapter is None:
                self.model.load_state_dict(named_tensors, strict=False)
            elif named_tensors:     # empty: only the clock (a resumed run)
                with torch.no_grad():
                    for n, t in self.adapter.buffers.items():
                        t.copy_(named_tensors[n])
                self.adapter.apply()
            self.version = int(version)
            self._awaiting_resend = False
        self._synced.set()

    @contextlib.contextmanager
    def weights_in_place(self, version: int):
        """The live tensors, for a Receiver to copy a version into bucket by bucket. The
        decode lock is held throughout, so no step sees a half-landed version; if landing
        fails part-way the engine serves nothing until a complete version arrives."""
        with self._lock, torch.no_grad():
            self._synced.clear()
            yield self._landing()
            if self.adapter is not None:
                self.adapter.apply()        # the landed adapter into the weights (merge) or nothing (peft)
            self.version = int(version)
            self._awaiting_resend = False
            self._synced.set()

    def _acquire_serving(self) -> None:
        """Take the decode lock on complete weights: a failed in-place load leaves half a
        version, and the step waits (bounded) for the next one rather than sample from it."""
        deadline = time.monotonic() + RESYNC_TIMEOUT_S
        while True:
            self._lock.acquire()
            if self._synced.is_set():
                return
            self._lock.release()
            if not self._synced.wait(timeout=max(0.0, deadline - time.monotonic())):
                raise RuntimeError(f"{self.engine_id} holds a partly loaded version and was not "
                                   f"re-sent weights within {RESYNC_TIMEOUT_S:.0f}s")

    def state_dict_ref(self):
        return {n: t.clone() for n, t in self.model.state_dict().items()}

    def mesh(self, method: str, *args, **kwargs):
        return mesh_call(self, method, *args, **kwargs)

    def abort_all(self) -> None:
        """Abort every request in flight now (used when a run stops or a window is closed)."""
        self._abort_before = time.time()

    def pop_stats(self) -> dict:
        """Since the last call: requests, tokens, busy_s (seconds spent decoding), decode_steps,
        running_rows_mean/max (rows per step) and queue_wait_s_mean/max (enqueued -> admitted;
        continuous batching only)."""
        with self._stats_lock:
            st, self.stats = self.stats, fresh_stats()
        return summarize_stats(st)

    def _count(self, **add) -> None:
        with self._stats_lock:
            for k, v in add.items():
                self.stats[k] += v

    def _count_step(self, rows: int) -> None:
        with self._stats_lock:
            self.stats["decode_steps"] += 1
            self.stats["_rows_sum"] += rows
            self.stats["running_rows_max"] = max(self.stats["running_rows_max"], rows)

    # ---- generation ----------------------------------------------------------------
    def generate(self, requests: list[dict]) -> list[dict]:
        """Each request: prompt_ids, max_new_tokens, temperature, top_p, [seed], [prefix_ids, prefix_logprobs,
        prefix_versions] (resume a partial rollout), [hold] (keep one version for the whole call).
        Returns per request: response_ids, logprobs, versions, status (completed|truncated|aborted|failed);
        a failed row (malformed, or its prompt does not fit the context) has `error` and `code`,
        and is not decoded: the other rows are served."""
        if not requests:
            return []
        wait_synced(self._synced, self.engine_id)
        t0 = time.time()
        groups: dict[tuple, list[int]] = {}
        queued: list[tuple[int, _Row]] = []
        out: list[dict] = [{}] * len(requests)
        for i, r in enumerate(requests):
            refused = row_error(r, self.context, self.vocab) or self._kv_error(r)
            if refused:
                out[i] = failed_row(*refused)
            elif self.batching == "continuous" and not r.get("hold", False):
                queued.append((i, self._row(r, t0)))
            else:   # static: one decode loop per sampling setting
                key = (int(r["max_new_tokens"]), float(r.get("temperature", 1.0)), float(r.get("top_p", 1.0)),
                       bool(r.get("hold", False)))
                groups.setdefault(key, []).append(i)
        self._enqueue([row for _, row in queued])
        for (max_new, temp, top_p, hold), same in groups.items():
            seqs = [list(requests[i]["prompt_ids"]) + list(requests[i].get("prefix_ids", [])) for i in same]
            for pack in self._packs(seqs, [self._need(requests[i]) for i in same]):
                idx = [same[j] for j in pack]
                t = time.time()
                for i, res in zip(idx, self._decode([requests[i] for i in idx], max_new, temp, top_p, hold, t0)):
                    out[i] = res
                self._count(busy_s=time.time() - t)
        for i, row in queued:
            out[i] = row.done.result()
        self._count(requests=len(requests), tokens=sum(len(o["response_ids"]) for o in out))
        return out

    def _need(self, r: dict) -> int:
        """KV cache columns a request may come to hold: its context and the most it may sample."""
        seq = len(r["prompt_ids"]) + len(r.get("prefix_ids", []))
        return seq + max(0, room(r, self.context))

    def _kv_error(self, r: dict) -> tuple[str, str] | None:
        need = self._need(r)
        if need <= self.kv_cache_tokens:
            return None
        seq = len(r["prompt_ids"]) + len(r.get("prefix_ids", []))
        return "context_length_exceeded", (
            f"the request needs {need} tokens of KV cache ({seq} of context + up to {need - seq} new), more than "
            f"the engine's {self.kv_cache_tokens} ({self.kv_cache_mb:g} MiB at {self.kv_token_bytes} bytes a token); "
            f"raise rollout.kv_cache_mb or lower max_new_tokens")

    def _packs(self, seqs: list[list[int]], needs: list[int]) -> list[list[int]]:
        """Indices of `seqs` in order, cut into batches that run together: a cut where a padded prefill's
        attention mask (distinct contexts x width^2) would pass PREFILL_MASK_ELEMS (one context alone has
        no padding, hence no mask, at any length), or where the KV cache (rows x widest need) would pass
        kv_cache_tokens (continuous batching admitted its rows within it already)."""
        packs: list[list[int]] = []
        seen: set[tuple] = set()
        width = widest = 0
        for i, (seq, need) in enumerate(zip(seqs, needs)):
            key = tuple(seq)
            mask = key not in seen and (len(seen) + 1) * max(width, len(seq)) ** 2 > PREFILL_MASK_ELEMS
            kv = (len(packs[-1]) + 1) * max(widest, need) > self.kv_cache_tokens if packs else False
            if not packs or mask or kv:
                packs.append([])
                seen, width, widest = set(), 0, 0
            packs[-1].append(i)
            seen.add(key)
            width, widest = max(width, len(seq)), max(widest, need)
        return packs

    # ---- continuous batching -------------------------------------------------------
    def _row(self, r: dict, t_dispatch: float) -> _Row:
        seq = list(r["prompt_ids"]) + list(r.get("prefix_ids", []))
        resp = list(r.get("prefix_ids", []))
        budget = int(r["max_new_tokens"]) - len(resp)
        if self.context:    # prompt + response never outgrow the context
            budget = min(budget, self.context - len(seq))
        return _Row(seq, resp, list(r.get("prefix_logprobs", [])), list(r.get("prefix_versions", [])), budget,
                    int(r["seed"]) if "seed" in r else None, float(r.get("temperature", 1.0)),
                    float(r.get("top_p", 1.0)), t_dispatch)

    def _enqueue(self, rows: list[_Row]) -> None:
        """Rows with nothing to decode (a resumed row that had ended, no budget) finish here; the
        rest wait for the decode thread, which is started if it is not running."""
        todo = []
        for row in rows:
            if row.resp and row.resp[-1] == self.eos_id:
                row.finish("completed")
            elif row.budget <= 0:
                row.finish("truncated")
            else:
                todo.append(row)
        if not todo:
            return
        with self._wake:
            self._waiting.extend(todo)
            self._wake.notify()
            if not self._scheduling:
                self._scheduling = True
                threading.Thread(target=self._schedule, name=f"{self.engine_id}-decode", daemon=True).start()

    def _schedule(self) -> None:
        """The decode thread: admit, step, retire, until idle for IDLE_EXIT_S."""
        running: list[_Row] = []
        batch: _Batch | None = None
        while True:
            with self._wake:
                if not running and not self._waiting:
                    self._wake.wait(timeout=IDLE_EXIT_S)
                    if not self._waiting:
                        self._scheduling = False
                        return
                for row in [r for r in self._waiting if self._aborted(r)]:
                    self._waiting.remove(row)
                    row.finish("aborted")
                admitted = self._admit(running)
            t = time.time()
            try:
                running, batch = self._iteration(running, batch, admitted)
            except Exception as e:  # noqa: BLE001 - the rows in hand fail with the engine's error; the thread goes on
                for row in running + admitted:
                    if not row.done.done():
                        row.done.set_exception(e)
                running, batch = [], None
            self._count(busy_s=time.time() - t)

    def _aborted(self, row: _Row) -> bool:
        return self._abort_before > row.t_dispatch

    def _admit(self, running: list[_Row]) -> list[_Row]:
        """Waiting rows, first come first served, while the batch has room for their rows and its KV
        cache, rows x the widest row's need, stays within kv_cache_tokens (the first row that does not
        fit waits at the head: later rows do not overtake it; generate refused any that fits nowhere)."""
        rows, widest, now = len(running), max((r.need for r in running), default=0), time.perf_counter()
        admitted = []
        while self._waiting and rows < self.max_running_rows:
            row = self._waiting[0]
            if rows and (rows + 1) * max(widest, row.need) > self.kv_cache_tokens:
                break
            admitted.append(self._waiting.popleft())
            rows, widest = rows + 1, max(widest, row.need)
        if admitted:
            waits = [now - r.t_queued for r in admitted]
            with self._stats_lock:
                self.stats["_wait_sum"] += sum(waits)
                self.stats["_waited"] += len(waits)
                self.stats["queue_wait_s_max"] = max(self.stats["queue_wait_s_max"], *waits)
        return admitted

    def _iteration(self, running, batch, admitted):
        """One decode step: the running rows' next token and the admitted rows' first (their prefill),
        in one hold of the weight lock; then the rows that ended leave and the admitted ones join."""
        for row in [r for r in running if self._aborted(r)]:
            row.finish("aborted")
        keep = [i for i, r in enumerate(running) if not r.done.done()]
        if len(keep) < len(running):
            running, batch = [running[i] for i in keep], (batch.select(keep) if keep else None)
        if not running and not admitted:
            return [], None
        with torch.no_grad():
            self._acquire_serving()
            try:
                step = self._step(batch) if running else None
                new, new_logits = self._prefill(admitted) if admitted else (None, None)
                version = self.version
            finally:
                self._lock.release()
        rows = running + admitted
        logits = torch.cat([x for x in (step, new_logits) if x is not None])
        self._count_step(len(rows))     # before sampling: it ends rows, and a caller may read the stats then
        tok = self._sample_rows(rows, logits.float(), version)
        batch = _Batch.concat(batch, new) if batch is not None and new is not None else (batch or new)
        batch.last = tok
        keep = [i for i, r in enumerate(rows) if not r.done.done()]
        return [rows[i] for i in keep], (batch.select(keep) if keep else None)

    def _step(self, batch: _Batch) -> torch.Tensor:
        """Feed every running row its last sampled token; the batch's cache and mask grow by one column."""
        mask = torch.cat([batch.mask, torch.ones_like(batch.mask[:, :1])], dim=1)
        o = self.model(input_ids=batch.last[:, None], attention_mask=mask, position_ids=batch.pos[:, None],
                       use_cache=True, **{self._cache_kw: batch.cache}, **self._last_only)
        batch.cache, batch.mask, batch.pos = o[self._cache_kw], mask, batch.pos + 1
        return o.logits[:, -1]

    def _prefill(self, rows: list[_Row]) -> tuple[_Batch, torch.Tensor]:
        """The admitted rows' first logits and KV cache, prefilled pack by pack (_packs), in order."""
        parts = [self._prefill_pack([rows[i] for i in pack])
                 for pack in self._packs([r.seq for r in rows], [r.need for r in rows])]
        batch = parts[0][0]
        for more, _ in parts[1:]:
            batch = _Batch.concat(batch, more)
        return batch, torch.cat([logits for _, logits in parts])

    def _prefill_pack(self, rows: list[_Row]) -> tuple[_Batch, torch.Tensor]:
        """Rows' contexts, left-padded; rows with the same context share one prefill."""
        n, width = len(rows), max(len(r.seq) for r in rows)
        ids = torch.full((n, width), self.pad_id, dtype=torch.long)
        mask = torch.zeros((n, width), dtype=torch.long)
        for i, r in enumerate(rows):
            ids[i, width - len(r.seq):] = torch.tensor(r.seq)
            mask[i, width - len(r.seq):] = 1
        pos = (mask.cumsum(-1) - 1).clamp(min=0)
        first: dict[tuple, int] = {}
        inv = torch.tensor([first.setdefault(tuple(r.seq), i) for i, r in enumerate(rows)])
        if len(first) < n:
            logits, cache = self._shared_prefill(ids, mask, pos, sorted(set(first.values())), inv)
        else:
            o = self.model(input_ids=ids, attention_mask=mask, position_ids=pos, use_cache=True, **self._last_only)
            logits, cache = o.logits[:, -1], o[self._cache_kw]
        return _Batch(cache, mask, torch.tensor([len(r.seq) for r in rows])), logits

    def _sample_rows(self, rows: list[_Row], logits: torch.Tensor, version: int) -> torch.Tensor:
        """One token per row, sampled per sampling setting; appended to each row, which finishes on
        EOS or its budget. Returns the tokens (the next step's input)."""
        tok = torch.empty(len(rows), dtype=torch.long)
        lp = torch.empty(len(rows), dtype=logits.dtype)
        settings: dict[tuple, list[int]] = {}
        for i, r in enumerate(rows):
            settings.setdefault((r.temp, r.top_p), []).append(i)
        for (temp, top_p), idx in settings.items():
            sel = torch.tensor(idx)
            tok[sel], lp[sel] = self._sample(logits[sel], temp, top_p, [rows[i].seed for i in idx],
                                             [len(rows[i].resp) for i in idx])
        for r, t, p in zip(rows, tok.tolist(), lp.tolist()):
            r.seq.append(t)
            r.resp.append(t)
            r.lps.append(p)
            r.vers.append(version)
            r.budget -= 1
            if t == self.eos_id:
                r.finish("completed")
            elif r.budget <= 0:
                r.finish("truncated")
        return tok

    def _decode(self, reqs, max_new, temp, top_p, hold, t_start):
        n = len(reqs)
        seqs = [list(r["prompt_ids"]) + list(r.get("prefix_ids", [])) for r in reqs]
        resp = [list(r.get("prefix_ids", [])) for r in reqs]
        lps = [list(r.get("prefix_logprobs", [])) for r in reqs]
        vers = [list(r.get("prefix_versions", [])) for r in reqs]
        done = [len(x) > 0 and x[-1] == self.eos_id for x in resp]
        # a request with its own seed samples token t from a uniform drawn by hash(seed, t): reproducible
        # whatever it is batched with, and a resumed partial rollout draws what an uninterrupted one would
        seeds = [int(r["seed"]) if "seed" in r else None for r in reqs]
        budget = [max_new - len(x) for x in resp]
        if self.context:    # prompt + response never outgrow the context: decode work per row is bounded
            budget = [min(b, self.context - len(s)) for b, s in zip(budget, seqs)]
        width = max(map(len, seqs))
        ids = torch.full((n, width), self.pad_id, dtype=torch.long)
        mask = torch.zeros((n, width), dtype=torch.long)
        for i, s in enumerate(seqs):  # left padding keeps the newest token in the last column
            ids[i, width - len(s):] = torch.tensor(s)
            mask[i, width - len(s):] = 1
        # Rows with the same context (a group's N samples of one prompt) share one prefill: it runs
        # on one row per distinct context and the KV cache is then copied out to every row.
        first: dict[tuple, int] = {}
        inv = torch.tensor([first.setdefault(tuple(s), i) for i, s in enumerate(seqs)])
        shared = sorted(set(first.values())) if len(first) < n else None
        cache, step_ids = None, ids
        if hold:
            self._acquire_serving()
        try:
            for _ in range(max(budget + [0])):
                if all(d or b <= 0 for d, b in zip(done, budget)) or self._abort_before > t_start:
                    break
                pos = (mask.cumsum(-1) - 1).clamp(min=0)[:, -step_ids.shape[1]:]
                with torch.no_grad():
                    if not hold:
                        self._acquire_serving()
                    try:
                        if cache is None and shared is not None:
                            logits, cache = self._shared_prefill(step_ids, mask, pos, shared, inv)
                        else:
                            o = self.model(input_ids=step_ids, attention_mask=mask, position_ids=pos,
                                           use_cache=True, **{self._cache_kw: cache}, **self._last_only)
                            logits, cache = o.logits[:, -1], o[self._cache_kw]
                        version = self.version
                    finally:
                        if not hold:
                            self._lock.release()
                tok, lp = self._sample(logits.float(), temp, top_p, seeds, [len(x) for x in resp])
                toks, lpl = tok.tolist(), lp.tolist()
                for i in range(n):
                    if done[i] or budget[i] <= 0:
                        continue
                    t = toks[i]
                    resp[i].append(t)
                    lps[i].append(lpl[i])
                    vers[i].append(version)
                    budget[i] -= 1
                    done[i] = t == self.eos_id
                alive = torch.tensor([not d and b > 0 for d, b in zip(done, budget)])
                step_ids = torch.where(alive, tok, torch.full_like(tok, self.pad_id)).unsqueeze(1)
                mask = torch.cat([mask, alive.long().unsqueeze(1)], dim=1)
        finally:
            if hold:
                self._lock.release()
        aborted = self._abort_before > t_start
        return [{"response_ids": resp[i], "logprobs": lps[i], "versions": vers[i],
                 "status": "completed" if done[i] else ("aborted" if aborted and budget[i] > 0 else "truncated")}
                for i in range(n)]

    def _shared_prefill(self, ids, mask, pos, rows: list[int], inv: torch.Tensor):
        """The prefill of `rows` only (one per distinct context); every row's last logits and KV cache."""
        sel = torch.tensor(rows)
        o = self.model(input_ids=ids[sel], attention_mask=mask[sel], position_ids=pos[sel], use_cache=True,
                       **self._last_only)
        cache = o[self._cache_kw]
        where = torch.full((int(inv.max()) + 1,), -1, dtype=torch.long)
        where[sel] = torch.arange(len(rows))
        cache.reorder_cache(where[inv])      # beam search's batch gather: row i gets its context's keys/values
        return o.logits[where[inv], -1], cache

    def _sample(self, logits: torch.Tensor, temp: float, top_p: float, seeds=None, steps=None):
        """Sample one token per row; logprob is under the tempered distribution (what the trainer computes).

        One uniform per row, then the inverse of the (top-p cut) CDF: the whole batch in a few
        vector ops. Rows with a seed take their uniform from `seeded_uniform(seed, step)` (step:
        the response token's index); the others from the engine's own generator. Rows go CDF_CELLS
        (rows x vocabulary) at a time: each [rows, V] tensor of the math is 39 MB at 64 rows of a
        151k vocabulary, and a handful of them lived at once."""
        u = None if temp <= 0 else self._uniforms(logits.shape[0], seeds, steps)
        step = max(1, CDF_CELLS // logits.shape[-1])
        if logits.shape[0] <= step:
            return sample_rows(logits, temp, top_p, u)
        parts = [sample_rows(logits[i:i + step], temp, top_p, None if u is None else u[i:i + step])
                 for i in range(0, logits.shape[0], step)]
        return torch.cat([t for t, _ in parts]), torch.cat([lp for _, lp in parts])

    def _uniforms(self, n: int, seeds=None, steps=None) -> torch.Tensor:
        """One uniform in (0, 1] per row: from the row's seed and step, or from the engine's generator."""
        seeds = seeds or [None] * n
        u = torch.empty(n, dtype=torch.float64)
        own = [i for i, x in enumerate(seeds) if x is None]
        if own:     # in (0, 1]
            u[own] = 1.0 - torch.rand(len(own), generator=self._gen, dtype=torch.float64)
        if len(own) < len(seeds):
            rows = [i for i, x in enumerate(seeds) if x is not None]
            u[rows] = torch.from_numpy(seeded_uniform([seeds[i] for i in rows], [steps[i] for i in rows]))
        return u


def sample_rows(logits: torch.Tensor, temp: float, top_p: float, u: torch.Tensor | None):
    """_sample's math on some rows: (tokens, their log-probs); greedy (u None) at temp <= 0."""
    if temp <= 0:  # greedy
        logp = torch.log_softmax(logits, -1)
        tok = logits.argmax(-1)
        return tok, logp.gather(-1, tok[:, None])[:, 0]
    logp = torch.log_softmax(logits / temp, -1)
    probs = logp.exp()
    if top_p < 1.0:
        sp, si = probs.sort(-1, descending=True)
        keep = sp.cumsum(-1) - sp < top_p
        probs = torch.zeros_like(probs).scatter(-1, si, sp * keep)
    tok = inverse_cdf(probs, u)
    return tok, logp.gather(-1, tok[:, None])[:, 0]


_M1, _M2, _GOLDEN = np.uint64(0xBF58476D1CE4E5B9), np.uint64(0x94D049BB133111EB), np.uint64(0x9E3779B97F4A7C15)


def _mix(z: np.ndarray) -> np.ndarray:
    """splitmix64's finaliser: every input bit flips about half the output bits (uint64, wrapping)."""
    z = (z ^ (z >> np.uint64(30))) * _M1
    z = (z ^ (z >> np.uint64(27))) * _M2
    return z ^ (z >> np.uint64(31))


def seeded_uniform(seeds, steps) -> np.ndarray:
    """A uniform in (0, 1] per (seed, step), a pure function of the pair (float64, 53 random bits)."""
    s = np.array([int(x) % 2 ** 64 for x in seeds], dtype=np.uint64)     # any int: an API caller's seed too
    t = np.asarray(steps, dtype=np.uint64)
    with np.errstate(over="ignore"):
        z = _mix(_mix(s * _GOLDEN + _GOLDEN) ^ (t * _GOLDEN))
    return ((z >> np.uint64(11)).astype(np.float64) + 1.0) * 2.0 ** -53


def inverse_cdf(probs: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """Per row, the first index whose cumulative probability reaches u x the row's total: a token of
    probability 0 is never chosen (u > 0), and rows need not sum to 1 (a top-p cut). Rows are taken
    CDF_CELLS at a time: the float64 CDF of 64 rows of a 151k vocabulary would be 78 MB, twice over."""
    step = max(1, CDF_CELLS // probs.shape[-1])
    if probs.shape[0] > step:
        return torch.cat([inverse_cdf(probs[i:i + step], u[i:i + step]) for i in range(0, probs.shape[0], step)])
    cdf = probs.double().cumsum(-1)
    target = (u * cdf[:, -1])[:, None]
    return (cdf < target).sum(-1).clamp(max=probs.shape[-1] - 1)
