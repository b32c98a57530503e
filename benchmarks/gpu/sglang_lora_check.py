"""GPU check for LoRA on the SGLang rollout engine: adapters synced, loaded and served.

On a CUDA machine (one GPU is enough): an SGLangEngine actor launched for LoRA
(trainer.lora's shape: --enable-lora, --max-lora-rank, --lora-target-modules) and a GPU
policy actor holding the same HF base wrapped in peft's LoRA layers. Then
  1. greedy generation at version 0 (no adapter: the base); tokens tagged 0; log-probs
     agree with the HF base's own (teacher-forced, same tokens);
  2. the policy sets its adapter to random values (lora_B is zero at start), the mesh
     publishes version 1: the bytes sent are the adapter's (not the model's), the engine
     writes it as a peft adapter and loads it with /load_lora_adapter;
  3. greedy generation again: outputs change, tokens are tagged 1, and the log-probs agree
     with the *peft model's* (base + adapter): SGLang serves the adapter the trainer has;
  4. versions 2 and 3 in a row while sampled requests run: each request keeps the version
     it was bound to (tags ordered, one version per request), the old adapters are unloaded.

    python benchmarks/gpu/sglang_lora_check.py [--model DIR] [--dtype bfloat16] [--rank 8]

Without CUDA (or without sglang) it says so and exits with status 1.
"""
from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path[0] = ROOT     # the repository first; not this folder


class GpuLoraPolicy:
    """The sender side: the HF base on the GPU in peft's LoRA layers; publishes the adapter alone."""

    def __init__(self, path: str, dtype: str, lora):
        import transfer
        from stages import lora as lora_lib
        from stages.model import load_model

        self.model = lora_lib.wrap(load_model(path, dtype).cuda(), lora, path)
        self.model.eval()
        self.adapter = lora_lib.adapter_params(self.model)
        self.mesh_endpoint = transfer.Sender(state_fn=lambda: {n: p.detach() for n, p in self.adapter.items()})

    def mesh(self, method, *args, **kwargs):
        return getattr(self.mesh_endpoint, method)(*args, **kwargs)

    def adapter_bytes(self) -> int:
        return sum(p.numel() * p.element_size() for p in self.adapter.values())

    def randomize(self, seed: int, scale: float) -> None:
        g = torch.Generator(device="cuda").manual_seed(seed)
        with torch.no_grad():
            for n, p in self.adapter.items():
                if ".lora_B." in n:
                    p.copy_(torch.randn(p.shape, generator=g, device="cuda", dtype=p.dtype) * scale)

    def logprobs(self, prompts, responses, base: bool = False) -> list[list[float]]:
        """Teacher-forced log-probs of `responses` under base + adapter (or the base alone)."""
        import contextlib

        out = []
        ctx = self.model.disable_adapter() if base else contextlib.nullcontext()
        with torch.no_grad(), ctx:
            for p, r in zip(prompts, responses):
                ids = torch.tensor([p + r], device="cuda")
                logits = self.model(input_ids=ids).logits[0, len(p) - 1: len(p) - 1 + len(r)].float()
                lp = torch.log_softmax(logits, -1)
                out.append(lp.gather(-1, torch.tensor(r, device="cuda")[:, None])[:, 0].tolist())
        return out


def max_gap(a, b) -> float:
    return max(abs(x - y) for u, v in zip(a, b) for x, y in zip(u, v))


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="", help="local HF model dir (default: the built-in tiny Qwen2, head_dim 64)")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--rank", type=int, default=8)
    ap.add_argument("--tolerance", type=float, default=0.1, help="max |engine - HF| log-prob gap allowed")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        print("sglang_lora_check: no CUDA device here; SGLang needs a GPU. Nothing was checked.")
        return 1
    try:
        import sglang  # noqa: F401
    except ImportError:
        print("sglang_lora_check: sglang is not installed (pip install 'loongsage[sglang]'). Nothing was checked.")
        return 1
    import ray

    from stages.agentflow.sglang_engine import SGLangConfig, SGLangEngine, check_lora_targets
    from stages.lora import LoraConfig, check_targets
    from stages.model import ModelConfig, load_tokenizer, resolve_model_path
    from stages.transfer_config import TransferConfig
    from transfer import TransferMesh

    path = args.model or resolve_model_path(ModelConfig(hidden_size=256, num_layers=4, warmup_steps=200,
                                                        cache_dir=os.path.join(tempfile.gettempdir(), "ls-models")))
    lora = LoraConfig(enabled=True, rank=args.rank, alpha=2.0 * args.rank)
    print("targets:", check_lora_targets(lora, path, check_targets(lora, path)))
    ray.init(address="local", include_dashboard=False, log_to_driver=False,
             runtime_env={"env_vars": {"PYTHONPATH": ROOT}})
    t0 = time.time()
    engine = ray.remote(SGLangEngine).options(num_gpus=0.5, max_concurrency=16).remote(
        path, args.dtype, 0, 1, "engine0", SGLangConfig(mem_fraction=0.3), lora)
    policy = ray.remote(GpuLoraPolicy).options(num_gpus=0.25).remote(path, args.dtype, lora)
    ray.get(engine.info.remote())
    print(f"engine up in {time.time() - t0:.1f}s")
    mesh = TransferMesh(policy, {"engine0": engine}, TransferConfig())
    mesh.discover()
    print({n: (r.transport, r.reason) for n, r in mesh.plan().items()})

    tok = load_tokenizer(path)
    texts = ["12+34=", "7+8=", "55+45=", "3+96=", "10+10=", "99+1="]
    prompts = [tok.encode(t, add_special_tokens=False) for t in texts]
    reqs = [{"prompt_ids": p, "max_new_tokens": 8, "temperature": 0.0} for p in prompts]
    failures = []

    def check(name: str, ok: bool, detail: str) -> None:
        print(f"{'PASS' if ok else 'FAIL'} {name}: {detail}")
        if not ok:
            failures.append(name)

    a = ray.get(engine.generate.remote(reqs))
    check("v0 versions", all(v == 0 for o in a for v in o["versions"]), str([o["versions"] for o in a][:2]))
    gap0 = max_gap([o["logprobs"] for o in a],
                   ray.get(policy.logprobs.remote(prompts, [o["response_ids"] for o in a], base=True)))
    check("v0 logprobs = HF base", gap0 < args.tolerance, f"max gap {gap0:.4f}")

    ray.get(policy.randomize.remote(seed=1, scale=0.05))
    m = mesh.publish(1)
    adapter_bytes = ray.get(policy.adapter_bytes.remote())
    print(f"publish v1: {m['transfer/seconds']:.3f}s over {mesh.routes['engine0'].transport}, "
          f"{m['transfer/payload_bytes'] / 1e6:.3f} MB, load {m.get('transfer/load_s', 0):.3f}s")
    check("bytes per sync = adapter", m["transfer/payload_bytes"] == adapter_bytes,
          f"{m['transfer/payload_bytes']:.0f} sent, adapter {adapter_bytes}")
    b = ray.get(engine.generate.remote(reqs))
    check("versions advance", ray.get(engine.weight_version.remote()) == 1
          and all(v == 1 for o in b for v in o["versions"]), str([o["versions"] for o in b][:2]))
    check("outputs change", [o["response_ids"] for o in a] != [o["response_ids"] for o in b],
          f"{[tok.decode(o['response_ids']) for o in a][:3]} -> {[tok.decode(o['response_ids']) for o in b][:3]}")
    gap1 = max_gap([o["logprobs"] for o in b],
                   ray.get(policy.logprobs.remote(prompts, [o["response_ids"] for o in b])))
    check("v1 logprobs = base + adapter (peft)", gap1 < args.tolerance, f"max gap {gap1:.4f}")

    # versions 2 and 3 while sampled requests run: a request keeps the adapter it was sent with
    long = [{"prompt_ids": p, "max_new_tokens": 48, "temperature": 1.0} for p in prompts * 8]
    ref = engine.generate.remote(long)
    time.sleep(0.05)
    for v in (2, 3):
        ray.get(policy.randomize.remote(seed=v, scale=0.05))
        mesh.publish(v)
    c = ray.get(ref)
    one = all(len(set(o["versions"])) <= 1 for o in c)
    check("one version per request", one, f"versions seen: {sorted({v for o in c for v in o['versions']})}")
    d = ray.get(engine.generate.remote(reqs))
    check("serves v3", all(v == 3 for o in d for v in o["versions"]), str([o["versions"] for o in d][:2]))
    gap3 = max_gap([o["logprobs"] for o in d],
                   ray.get(policy.logprobs.remote(prompts, [o["response_ids"] for o in d])))
    check("v3 logprobs = base + adapter (peft)", gap3 < args.tolerance, f"max gap {gap3:.4f}")
    ray.get(engine.close.remote())
    mesh.close()
    ray.shutdown()
    print("sglang_lora_check:", "OK" if not failures else f"FAILED {failures}")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
