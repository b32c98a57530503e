"""Embedded rollout engine: an HF causal LM in a Ray actor, token ids in; ids, log-probs and versions out.

Our own decode loop, not `model.generate`: per token we need the sampled id, its log-prob under the
distribution sampled from (logits / temperature, as the trainer computes it) and the weight version
that produced it. One decode thread owns a running batch (continuous batching): between two steps it
retires finished and aborted rows and admits waiting ones (one prefill per distinct context, their KV
cache joined to the batch's, left-padded). A step is one forward under the weight lock, so a version
lands between steps and a row spanning an update records both versions (partial rollout); a `hold`
call keeps one version (VersionGate). With trainer.lora a version is the adapter alone (stages/lora.py).

Memory follows the response, not vocabulary x prompt: the LM head runs at the last position only, the
KV cache is bounded by engine.kv_cache_mb (_admit, _kv_error), distinct contexts are prefilled in packs
(_prefill) and sampling takes a few rows at a time (sampling.py).
"""
from __future__ import annotations

import contextlib
import functools
import threading
import time
from collections import deque
from concurrent.futures import Future
from dataclasses import dataclass, field

import torch

from stages.agentflow.engine_contract import EngineBase
from stages.agentflow.limits import room
from stages.agentflow.sampling import sample, seeded_uniform
from stages.lora import SERVERS, LoraConfig
from stages.model import load_model, load_tokenizer
from stages.priority import lower_priority
from transfer.compat.transformers_api import cache_kv, forward_kwargs, set_cache_kv

IDLE_EXIT_S = 1.0                    # the decode thread ends after this long with nothing to do (restarted on demand)
KV_CACHE_MB = 1024.0                 # default engine.kv_cache_mb
PREFILL_MASK_ELEMS = 2 ** 24         # a padded prefill's attention mask (distinct contexts x width^2) at most
RESYNC_TIMEOUT_S = 120.0             # a version that failed part-way in place waits this long for the next one


@dataclass(eq=False)
class _Row:
    """One request: its whole context, what it has sampled, what it may still sample."""
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


@dataclass
class _Batch:
    """Rows' KV cache, left-padded: `mask` marks real cache columns per row; `pos` is the position id
    of each row's next token, `last` that token (sampled, not yet in the cache)."""
    cache: object
    mask: torch.Tensor          # [rows, columns] long
    pos: torch.Tensor           # [rows] long
    last: torch.Tensor | None = None

    def select(self, keep: list[int]) -> _Batch:
        """The rows in `keep` (a row may repeat), their cache gathered; columns that are padding in
        every kept row are dropped."""
        idx = torch.tensor(keep)
        mask = self.mask[idx]
        lead = int((mask.sum(0) == 0).long().cumprod(0).sum())       # all-padding columns on the left
        set_cache_kv(self.cache, [(k[idx, :, lead:], v[idx, :, lead:]) for k, v in cache_kv(self.cache)])
        return _Batch(self.cache, mask[:, lead:], self.pos[idx], None if self.last is None else self.last[idx])

    def join(self, b: _Batch) -> _Batch:
        """b's rows after these, both right-aligned on the newest column (the shorter padded on the left)."""
        width = max(self.mask.shape[1], b.mask.shape[1])

        def pad(t, dim):
            shape = list(t.shape)
            shape[dim] = width - shape[dim]
            return torch.cat([t.new_zeros(shape), t], dim=dim) if shape[dim] else t

        set_cache_kv(self.cache, [(torch.cat([pad(ka, 2), pad(kb, 2)]), torch.cat([pad(va, 2), pad(vb, 2)]))
                                   for (ka, va), (kb, vb) in zip(cache_kv(self.cache), cache_kv(b.cache))])
        return _Batch(self.cache, torch.cat([pad(self.mask, 1), pad(b.mask, 1)]), torch.cat([self.pos, b.pos]))


class HFEngine(EngineBase):
    """Continuous-batching sampling with a KV cache. Runs as a threaded Ray actor (max_concurrency > 1)."""

    def __init__(self, model_path: str, dtype: str = "float32", seed: int = 0, num_threads: int = 1,
                 engine_id: str = "engine0", nice: int = 0, lora: LoraConfig | None = None,
                 max_running_rows: int = 256, kv_cache_mb: float = KV_CACHE_MB,
                 special_ids: tuple[int, int] | None = None):
        """special_ids: (eos, pad), all generation needs of the tokenizer, from a process that loaded it
        (a 151k-token tokenizer costs ~200 MB to load); without them the engine loads it (`self.tok`)."""
        lower_priority(nice)
        self.threads = max(1, num_threads)
        self.about = {"threads": self.threads, "engine": "hf"}
        torch.set_num_threads(self.threads)
        self._start(engine_id)
        self.model = load_model(model_path, dtype)
        self._cache_kw, self._last_only = forward_kwargs(self.model)     # asked before a peft wrapper hides them
        self.adapter = SERVERS[lora.serve](self.model, lora) if lora is not None and lora.enabled else None
        if self.adapter is not None:
            self.model = self.adapter.model
        if special_ids is None:
            self.tok = load_tokenizer(model_path)
            special_ids = (self.tok.eos_token_id, self.tok.pad_token_id)
        self.eos_id, self.pad_id = special_ids
        self.context = int(getattr(self.model.config.get_text_config(), "max_position_embeddings", 0) or 0)
        self.vocab = self.model.get_input_embeddings().num_embeddings
        self.max_running_rows, self.kv_cache_mb = max_running_rows, kv_cache_mb
        with torch.no_grad():   # the KV cache bytes a token takes, measured (config fields differ by architecture)
            o = self.model(input_ids=torch.zeros((1, 1), dtype=torch.long), use_cache=True, **self._last_only)
        self.kv_token_bytes = max(1, sum(t.nbytes for kv in cache_kv(o[self._cache_kw]) for t in kv))
        self.kv_cache_tokens = int(kv_cache_mb * 2 ** 20 // self.kv_token_bytes)   # cache columns x rows, at most
        self._lock = threading.Lock()                   # a decode step or a weight update
        self._whole = threading.Event()                 # clear while a version lands in place
        self._whole.set()
        self._gen = torch.Generator().manual_seed(seed)
        self._abort_before = -1.0                       # requests dispatched before this time are aborted
        self._waiting: deque[_Row] = deque()            # rows enqueued by generate, not yet admitted
        self._wake = threading.Condition()              # guards _waiting and _scheduling
        self._scheduling = False                        # the decode thread is running

    # ---- weights ------------------------------------------------------------------
    def _landing(self) -> dict:
        """The tensors a version is written into: the model's, or the adapter's buffers."""
        return self.model.state_dict() if self.adapter is None else self.adapter.buffers

    def weight_specs(self) -> dict:
        return {n: (tuple(t.shape), t.dtype) for n, t in self._landing().items()}

    def load_weights(self, named_tensors: dict, version: int) -> None:
        """Apply one complete version between decode steps (empty: only the clock, a resumed run)."""
        with self.weights_in_place(version) as live:
            for n, t in named_tensors.items():
                if n in live:
                    live[n].copy_(t)

    @contextlib.contextmanager
    def weights_in_place(self, version: int):
        """The live tensors, for a Receiver to copy a version into bucket by bucket, under the decode lock
        and after the hold calls in flight; if landing fails part-way the engine serves nothing until a
        complete version arrives."""
        with self._gate.updating(), self._lock, torch.no_grad():
            self._whole.clear()
            yield self._landing()
            if self.adapter is not None:
                self.adapter.apply()        # the landed adapter into the weights (merge) or nothing (peft)
            self._whole.set()
            self._landed(version)

    def _acquire_serving(self) -> None:
        """Take the decode lock on complete weights (a failed in-place load leaves half a version):
        wait, bounded, for the next one rather than sample from it."""
        deadline = time.monotonic() + RESYNC_TIMEOUT_S
        while self._lock.acquire() and not self._whole.is_set():
            self._lock.release()
            if not self._whole.wait(timeout=max(0.0, deadline - time.monotonic())):
                raise RuntimeError(f"{self.engine_id} holds a partly loaded version and was not "
                                   f"re-sent weights within {RESYNC_TIMEOUT_S:.0f}s")

    def abort_all(self) -> None:
        self._abort_before = time.time()

    # ---- generation ----------------------------------------------------------------
    def generate(self, requests: list[dict]) -> list[dict]:
        """The contract's generate (engine_contract.py): rows join the running batch and this call
        waits for them; a row the KV cache cannot hold alone fails."""
        out, todo = self._plan(requests, refuse=self._kv_error)
        t0 = time.time()
        rows = [(i, _Row(list(r["prompt_ids"]) + list(r.get("prefix_ids", [])), list(r.get("prefix_ids", [])),
                         list(r.get("prefix_logprobs", [])), list(r.get("prefix_versions", [])), budget,
                         int(r["seed"]) if "seed" in r else None, float(r.get("temperature", 1.0)),
                         float(r.get("top_p", 1.0)), t0))
                for i, r, budget in todo]
        with self._gate.holding(any(r.get("hold") for _, r, _ in todo)):
            self._enqueue([row for _, row in rows])
            for i, row in rows:
                out[i] = row.done.result()
        return self._served(out)

    def _kv_error(self, r: dict) -> tuple[str, str] | None:
        seq = len(r["prompt_ids"]) + len(r.get("prefix_ids", []))
        need = seq + max(0, room(r, self.context))
        if need <= self.kv_cache_tokens:
            return None
        return "context_length_exceeded", (
            f"the request needs {need} tokens of KV cache ({seq} of context + up to {need - seq} new), more than "
            f"the engine's {self.kv_cache_tokens} ({self.kv_cache_mb:g} MiB at {self.kv_token_bytes} bytes a token); "
            f"raise engine.kv_cache_mb or lower max_new_tokens")

    def _enqueue(self, rows: list[_Row]) -> None:
        """Rows wait for the decode thread, which is started if it is not running."""
        if not rows:
            return
        with self._wake:
            self._waiting.extend(rows)
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
                for row in [r for r in self._waiting if self._abort_before > r.t_dispatch]:
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
            self._count_waits([now - r.t_queued for r in admitted])
        return admitted

    def _iteration(self, running: list[_Row], batch: _Batch | None, admitted: list[_Row]):
        """One decode step: the running rows' next token and the admitted rows' first (their prefill),
        in one hold of the weight lock; then the rows that ended leave and the admitted ones join."""
        for row in [r for r in running if self._abort_before > r.t_dispatch]:
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
        batch = batch.join(new) if batch is not None and new is not None else (batch or new)
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
        """The rows' KV cache and first logits: each distinct context prefilled once (a group's n samples
        share one), in packs whose padded attention mask (contexts x width^2) stays under PREFILL_MASK_ELEMS
        (one context alone has no padding, hence no mask, at any length); then each row gets its context's."""
        first: dict[tuple, int] = {}
        which = [first.setdefault(tuple(r.seq), len(first)) for r in rows]
        packs: list[list[tuple]] = [[]]
        for seq in first:
            if packs[-1] and (len(packs[-1]) + 1) * max(len(seq), *map(len, packs[-1])) ** 2 > PREFILL_MASK_ELEMS:
                packs.append([])
            packs[-1].append(seq)
        parts = [self._prefill_pack(p) for p in packs]
        batch = functools.reduce(_Batch.join, [b for b, _ in parts])
        return batch.select(which), torch.cat([logits for _, logits in parts])[which]

    def _prefill_pack(self, seqs: list[tuple]) -> tuple[_Batch, torch.Tensor]:
        n, width = len(seqs), max(map(len, seqs))
        ids = torch.full((n, width), self.pad_id, dtype=torch.long)
        mask = torch.zeros((n, width), dtype=torch.long)
        for i, s in enumerate(seqs):    # left padding keeps the newest token in the last column
            ids[i, width - len(s):] = torch.tensor(s)
            mask[i, width - len(s):] = 1
        o = self.model(input_ids=ids, attention_mask=mask, position_ids=(mask.cumsum(-1) - 1).clamp(min=0),
                       use_cache=True, **self._last_only)
        return _Batch(o[self._cache_kw], mask, torch.tensor([len(s) for s in seqs])), o.logits[:, -1]

    def _sample_rows(self, rows: list[_Row], logits: torch.Tensor, version: int) -> torch.Tensor:
        """One token per row, appended to it; a row finishes on EOS or its budget. Returns the tokens."""
        tok, lp = sample(logits, torch.tensor([r.temp for r in rows]), torch.tensor([r.top_p for r in rows]),
                         self._uniforms(rows))
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

    def _uniforms(self, rows: list[_Row]) -> torch.Tensor:
        """One uniform in (0, 1] per row. A seeded row's is seeded_uniform(seed, index of the token in its
        response): it samples the same whatever it is batched with, and a resumed row draws what an
        uninterrupted one would. An unseeded row's comes from the engine's generator; greedy rows draw none."""
        u = torch.ones(len(rows), dtype=torch.float64)
        own = [i for i, r in enumerate(rows) if r.temp > 0 and r.seed is None]
        if own:
            u[own] = 1.0 - torch.rand(len(own), generator=self._gen, dtype=torch.float64)
        seeded = [i for i, r in enumerate(rows) if r.temp > 0 and r.seed is not None]
        if seeded:
            u[seeded] = torch.from_numpy(seeded_uniform([rows[i].seed for i in seeded],
                                                        [len(rows[i].resp) for i in seeded]))
        return u
