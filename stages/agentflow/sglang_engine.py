"""Scale-out rollout engine: an SGLang server in a Ray actor, behind the engine contract (engine_contract.py).

The actor launches `python -m sglang.launch_server` on the GPUs Ray gave it (TP across them) and
speaks its HTTP API, as slime does: token ids in (`input_ids`); ids, log-probs and per-token weight
versions out (`meta_info.output_token_logprobs`, `meta_info.weight_versions`). A server process, not
an in-process `sglang.Engine`: the actor is threaded and the Engine's event loop is not; the server
batches concurrent requests itself. SGLang's log-probs are those of logits / temperature.

Weights (the TransferMesh drives them) go to the server with update_weights_from_tensor. A version lands
whole: generation is paused (`retract`: running requests continue under the new weights, each token tagged
with its version: partial rollout), after the `hold` requests in flight.

LoRA (trainer.lora on): the server runs the base with SGLang's LoRA support and a version is the
adapter alone, written as a peft directory and loaded with /load_lora_adapter as v<version>; a
request is bound to one adapter for its whole life (AdapterSlots), so updates never pause
generation. The file route, not /load_lora_adapter_from_tensors: the file API is the same across
SGLang releases, the tensor one changed its fields; an adapter is small.
GPU only: benchmarks/gpu/sglang_check.py runs it where a GPU is lent.
"""
from __future__ import annotations

import dataclasses
import os
import socket
import subprocess
import tempfile
import threading
import time

import torch

from stages.agentflow.engine_config import SGLangConfig
from stages.agentflow.engine_contract import STATUS, EngineBase
from stages.agentflow.sampling import sampling_of
from stages.lora import LoraConfig, meta_model
from transfer.compat.sglang_api import launch_command, request, serialize_tensors


def versions_of(meta: dict, n: int) -> list[int]:
    """Per-token weight versions from SGLang's spans ([{version, start, end}, ...]);
    servers that report only one version get it for every token."""
    out = [int(s["version"]) for s in meta.get("weight_versions") or [] for _ in range(s["start"], min(s["end"], n))]
    return out + [out[-1] if out else int(meta["weight_version"])] * (n - len(out))


def parse_output(out: dict, prefix: dict, version: int | None = None) -> dict:
    """One /generate result -> the engine contract (prefix of a resumed partial rollout first).
    `version`: every new token's version (a LoRA request, bound to one adapter); else the server's."""
    meta = out["meta_info"]
    pairs = meta.get("output_token_logprobs") or []         # [logprob, token_id, text] per token
    ids = [int(p[1]) for p in pairs]
    finish = (meta.get("finish_reason") or {}).get("type", "abort")
    versions = versions_of(meta, len(ids)) if version is None else [int(version)] * len(ids)
    return {"response_ids": list(prefix.get("prefix_ids", [])) + ids,
            "logprobs": list(prefix.get("prefix_logprobs", [])) + [float(p[0]) for p in pairs],
            "versions": list(prefix.get("prefix_versions", [])) + versions,
            "status": STATUS.get(finish, "aborted")}


# the module names SGLang's --lora-target-modules takes (it adapts every layer's module of a name)
SGLANG_LORA_MODULES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def check_lora_targets(lora: LoraConfig, model_path: str, targets: list[str]) -> list[str]:
    """The module names SGLang is launched with for these targets; ValueError naming the key when
    SGLang cannot serve them as the trainer trains them."""
    if lora.modules_to_save:
        raise ValueError("trainer.lora.modules_to_save: engine.kind=sglang serves LoRA adapters only (no module "
                         "trained in full beside them); leave it empty")
    names = sorted({t.rsplit(".", 1)[-1] for t in targets})
    unknown = [n for n in names if n not in SGLANG_LORA_MODULES]
    if unknown:
        raise ValueError(f"{lora.targets_key}: engine.kind=sglang serves LoRA on {', '.join(SGLANG_LORA_MODULES)} "
                         f"only, not {', '.join(unknown)}")
    every = [n for n, _ in meta_model(model_path).named_modules() if n.rsplit(".", 1)[-1] in names]
    if sorted(every) != sorted(targets):
        missing = sorted(set(every) - set(targets))
        raise ValueError(f"{lora.targets_key}: engine.kind=sglang adapts every layer's {', '.join(names)}; the "
                         f"targets leave out {len(missing)} of them (e.g. {missing[0]}): use trainer.lora."
                         "target_modules names")
    return names


def lora_module_names(specs: dict) -> list[str]:
    """The module names (q_proj, ...) an adapter's saved-adapter keys cover."""
    return sorted({n.removeprefix("base_model.model.").split(".lora_")[0].rsplit(".", 1)[-1] for n in specs})


def lora_server_args(lora: LoraConfig, names: list[str]) -> dict:
    """launch_server flags for serving adapters of this shape (two at once: the current version and
    the previous one, while requests bound to it finish)."""
    return {"enable-lora": True, "max-lora-rank": lora.rank, "lora-target-modules": list(names),
            "max-loras-per-batch": 2}


class SGLangEngine(EngineBase):
    """A threaded Ray actor with num_gpus = cfg.tp (the server uses exactly the GPUs Ray assigned)."""

    def __init__(self, model_path: str, dtype: str = "bfloat16", seed: int = 0, num_threads: int = 1,
                 engine_id: str = "engine0", cfg: SGLangConfig | None = None, lora: LoraConfig | None = None):
        if not torch.cuda.is_available():
            raise RuntimeError("SGLangEngine needs a CUDA GPU (SGLang has no CPU path for this model); "
                               "use engine.kind=hf on CPU")
        torch.set_num_threads(num_threads)
        self._start_library(model_path, dtype, engine_id, cfg or SGLangConfig(), lora)
        self.tp, self.device = self.cfg.tp, torch.device("cuda", torch.cuda.current_device())
        if self.lora is not None:
            # the module names SGLang adapts (every layer's; the controller checked the targets are those)
            self._lora_names = lora_module_names(self._specs)
            # the adapter files name their targets as SGLang reads them: a list of names, never a regex
            self._lora_files = dataclasses.replace(self.lora, target_regex="", target_modules=tuple(self._lora_names))
        server = self.cfg.server_args
        self.context = int(server.get("context-length") or server.get("context_length") or self.context)
        self._update_lock = threading.Lock()
        self._launch(seed)

    # ---- the server ------------------------------------------------------------------
    def _launch(self, seed: int) -> None:
        c = self.cfg
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            self.port = s.getsockname()[1]
        self.url = f"http://127.0.0.1:{self.port}"
        self.about = {"server": self.url, "engine": "sglang"}
        args = {"model-path": self.model_path, "host": "127.0.0.1", "port": self.port, "tp-size": c.tp,
                "dtype": self.dtype, "random-seed": seed, "mem-fraction-static": c.mem_fraction,
                "weight-version": "0", "skip-tokenizer-init": True}
        if self.lora is not None:
            args |= lora_server_args(self.lora, self._lora_names)
        args |= dict(c.server_args)
        cmd = launch_command(args)
        self.log_path = os.path.join(tempfile.gettempdir(), f"loongsage-sglang-{self.engine_id}-{self.port}.log")
        log = open(self.log_path, "w")
        # its own session: the server and its TP workers are stopped as one group in close()
        self.proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        deadline = time.time() + c.startup_timeout_s
        while time.time() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"SGLang server exited with {self.proc.returncode}:\n{self._log_tail()}")
            try:
                if request("GET", self.url, "/health_generate", None, 5).status_code == 200:
                    return
            except OSError:
                pass
            time.sleep(2)
        self.close()
        raise TimeoutError(f"SGLang server not ready after {c.startup_timeout_s:.0f}s:\n{self._log_tail()}")

    def _log_tail(self) -> str:
        with open(self.log_path) as f:
            return f.read()[-4000:]

    def _post(self, path: str, payload: dict) -> dict:
        r = request("POST", self.url, path, payload, self.cfg.request_timeout_s)
        if r.status_code != 200:
            raise RuntimeError(f"SGLang {path} failed ({r.status_code}): {r.text[:2000]}")
        return r.json() if r.content else {}

    def close(self) -> None:
        if getattr(self, "proc", None) is not None and self.proc.poll() is None:
            os.killpg(self.proc.pid, 15)
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, 9)
        if self._slots is not None:
            self._slots.remove()

    # ---- weights ------------------------------------------------------------------
    def load_weights(self, named_tensors: dict, version: int) -> None:
        """Bucket by bucket, each first copied into memory this process owns on its GPU (the landed tensors
        may be views of another process's IPC buffer, or in host memory), then shared with the server's TP
        workers as CUDA IPC handles."""
        if self.lora is not None:
            return self._load_adapter(named_tensors, version)
        buckets = list(self._buckets(named_tensors))
        # one update at a time, with generation paused (queued requests wait for continue_generation)
        with self._update_lock, self._gate.updating():
            self._post("/pause_generation", {"mode": self.cfg.pause_mode})
            try:
                if not buckets:     # no weights, only the clock (a resumed run): the server tags tokens with it
                    self._post("/update_weight_version", {"new_version": str(version), "abort_all_requests": False})
                for i, bucket in enumerate(buckets):
                    owned = [(n, t.to(self.device, copy=True)) for n, t in bucket]
                    torch.cuda.current_stream(self.device).synchronize()
                    last = i == len(buckets) - 1
                    self._post("/update_weights_from_tensor", {
                        "serialized_named_tensors": [serialize_tensors(owned)] * self.tp,     # one per TP rank
                        "flush_cache": last, "weight_version": str(version) if last else None})
                    del owned
                self._landed(version)
            finally:
                self._post("/continue_generation", {})

    def _add_adapter(self, version: int) -> None:
        self._post("/load_lora_adapter", {"lora_name": f"v{version}", "lora_path": self._slots.path(version)})

    def _remove_adapter(self, version: int) -> None:
        self._post("/unload_lora_adapter", {"lora_name": f"v{version}"})

    def _buckets(self, named: dict):
        bucket, size = [], 0
        for n, t in named.items():
            if bucket and size + t.nbytes > self.cfg.bucket_bytes:
                yield bucket
                bucket, size = [], 0
            bucket.append((n, t))
            size += t.nbytes
        if bucket:
            yield bucket

    def abort_all(self) -> None:
        self._post("/abort_request", {"abort_all": True})

    # ---- generation ----------------------------------------------------------------
    def generate(self, requests: list[dict]) -> list[dict]:
        """The contract's generate (engine_contract.py). SGLang refuses a whole batch if one row's input +
        max_new_tokens reaches its context: rows are checked and clipped here (reserve=1) instead."""
        out, todo = self._plan(requests, reserve=1)
        t0 = time.time()
        if todo:
            payload = {"input_ids": [list(r["prompt_ids"]) + list(r.get("prefix_ids", [])) for _, r, _ in todo],
                       "sampling_params": [self._sampling(r, b) for _, r, b in todo],
                       "return_logprob": True, "logprob_start_len": -1}
            adapter = self._slots.bind() if self._slots is not None else None
            if adapter is not None:
                payload["lora_path"] = [f"v{adapter}"] * len(todo)
            version = None if self._slots is None else self.version if adapter is None else adapter    # parse_output's
            try:
                with self._gate.holding(any(r.get("hold") for _, r, _ in todo)):
                    results = self._post("/generate", payload)
            finally:
                if self._slots is not None:
                    self._unload(self._slots.unbind(adapter))
            for (i, r, _), res in zip(todo, results if isinstance(results, list) else [results]):
                out[i] = parse_output(res, r, version)
        self._count(busy_s=time.time() - t0)
        return self._served(out)

    @staticmethod
    def _sampling(r: dict, budget: int) -> dict:
        s = sampling_of(r)
        params = {"max_new_tokens": budget, "temperature": s.temperature, "top_p": s.top_p,
                  "skip_special_tokens": False, "no_stop_trim": True}
        if s.seed is not None:     # the sample's own stream, advanced past a resumed prefix
            params["sampling_seed"] = s.seed
        return params
