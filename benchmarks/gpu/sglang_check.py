"""GPU check for the SGLang rollout engine: generate -> weight update -> generate.

On a CUDA machine (one GPU is enough): starts an SGLangEngine actor and a GPU policy
actor that holds the same HF weights, both on the one GPU, so the TransferMesh routes
CUDA IPC. Then
  0. the engine contract's checks (tests/support/engine_checks.py), the ones the HF engine passes in
     the default test run and vLLM in the `vllm` tier: rows aligned, seeds, greedy, refusals, resume;
  1. greedy generation: every token tagged version 0; the engine's log-probs agree with
     the HF model's own (teacher-forced, same tokens);
  2. the policy perturbs its weights, the mesh publishes version 1, the engine applies it
     with update_weights_from_tensor;
  3. greedy generation again: outputs change, every token is tagged version 1, and the
     log-probs now agree with the *perturbed* HF model: the engine serves the new weights;
  4. partial rollout: a version published while long samples are running; tokens keep
     the version that produced them (reported), then abort_all returns aborted requests.
It ends with one table: check, PASS/FAIL, what was seen.

    python benchmarks/gpu/sglang_check.py [--model DIR] [--dtype bfloat16]

Without CUDA (or without sglang) it says so and exits with status 1.
"""
from __future__ import annotations

import argparse
import os
import sys
import tempfile
import threading
import time

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path[0] = ROOT     # the repository first; not this folder


class GpuPolicy:
    """The sender side: an HF model on the GPU, its weights published through the mesh."""

    def __init__(self, path: str, dtype: str):
        import transfer
        from stages.model import load_model

        self.model = load_model(path, dtype).cuda()
        self.mesh_endpoint = transfer.Sender(state_fn=lambda: {n: t.detach() for n, t in
                                                                self.model.state_dict().items()})

    def mesh(self, method, *args, **kwargs):
        return getattr(self.mesh_endpoint, method)(*args, **kwargs)

    def perturb(self, seed: int, scale: float) -> None:
        g = torch.Generator(device="cuda").manual_seed(seed)
        with torch.no_grad():
            for p in self.model.parameters():
                p.add_(torch.randn(p.shape, generator=g, device="cuda", dtype=p.dtype) * p.float().std() * scale)

    def logprobs(self, prompts: list[list[int]], responses: list[list[int]], temperature: float) -> list[list[float]]:
        """Teacher-forced log-probs of `responses` (what the engine should have reported)."""
        out = []
        with torch.no_grad():
            for p, r in zip(prompts, responses):
                ids = torch.tensor([p + r], device="cuda")
                logits = self.model(input_ids=ids).logits[0, len(p) - 1: len(p) - 1 + len(r)].float()
                lp = torch.log_softmax(logits / (temperature or 1.0), -1)
                out.append(lp.gather(-1, torch.tensor(r, device="cuda")[:, None])[:, 0].tolist())
        return out


def max_gap(a: list[list[float]], b: list[list[float]]) -> float:
    return max(abs(x - y) for u, v in zip(a, b) for x, y in zip(u, v))


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="", help="local HF model dir (default: the built-in tiny Qwen2, head_dim 64)")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--tolerance", type=float, default=0.1, help="max |engine - HF| log-prob gap allowed")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        print("sglang_check: no CUDA device here; SGLang needs a GPU. Nothing was checked.")
        return 1
    try:
        import sglang  # noqa: F401
    except ImportError:
        print("sglang_check: sglang is not installed (pip install 'loongsage[sglang]'). Nothing was checked.")
        return 1
    import ray

    import tests.support.engine_checks as contract
    from stages.agentflow.limits import model_limits
    from stages.agentflow.sglang_engine import SGLangConfig, SGLangEngine
    from stages.model import ModelConfig, load_tokenizer, resolve_model_path
    from stages.transfer_config import TransferConfig
    from transfer import TransferMesh

    path = args.model or resolve_model_path(ModelConfig(hidden_size=256, num_layers=4, warmup_steps=200,
                                                        cache_dir=os.path.join(tempfile.gettempdir(), "ls-models")))
    ray.init(address="local", include_dashboard=False, log_to_driver=False,
             runtime_env={"env_vars": {"PYTHONPATH": ROOT}})
    t0 = time.time()
    engine = ray.remote(SGLangEngine).options(num_gpus=0.5, max_concurrency=16).remote(
        path, args.dtype, 0, 1, "engine0", SGLangConfig(mem_fraction=0.3))
    policy = ray.remote(GpuPolicy).options(num_gpus=0.25).remote(path, args.dtype)
    ray.get(engine.info.remote())
    print(f"engine up in {time.time() - t0:.1f}s")
    mesh = TransferMesh(policy, {"engine0": engine}, TransferConfig())
    mesh.discover()
    print({n: (r.transport, r.reason) for n, r in mesh.plan().items()})

    tok = load_tokenizer(path)
    texts = ["12+34=", "7+8=", "55+45=", "3+96=", "10+10=", "99+1="]
    prompts = [tok.encode(t, add_special_tokens=False) for t in texts]
    reqs = [{"prompt_ids": p, "max_new_tokens": 8, "temperature": 0.0} for p in prompts]
    table: list[tuple[str, bool, str]] = []

    def check(name: str, ok: bool, detail: str) -> None:
        table.append((name, ok, detail))

    generate = lambda rows: ray.get(engine.generate.remote(rows))  # noqa: E731
    for name, fn, extra in [("contract: generation", contract.check_generation, ()),
                            ("contract: refusals", contract.check_refusals, (model_limits(path)[0],)),
                            ("contract: resume", contract.check_resume, ())]:
        try:
            check(name, True, fn(generate, tok.eos_token_id, prompts, *extra))
        except AssertionError as e:
            check(name, False, str(e)[:200])

    t = time.time()
    a = ray.get(engine.generate.remote(reqs))
    print(f"generate v0: {time.time() - t:.2f}s, {sum(len(o['response_ids']) for o in a)} tokens")
    check("v0 versions", all(v == 0 for o in a for v in o["versions"]), str([o["versions"] for o in a][:2]))
    gap0 = max_gap([o["logprobs"] for o in a],
                   ray.get(policy.logprobs.remote(prompts, [o["response_ids"] for o in a], 0.0)))
    check("v0 logprobs = HF", gap0 < args.tolerance, f"max gap {gap0:.4f}")

    ray.get(policy.perturb.remote(seed=1, scale=0.5))
    m = mesh.publish(1)
    print(f"publish v1: {m['transfer/seconds']:.3f}s over {mesh.routes['engine0'].transport}, "
          f"{m['transfer/state_bytes'] / 1e6:.1f} MB, load {m.get('transfer/load_s', 0):.3f}s")
    b = ray.get(engine.generate.remote(reqs))
    check("versions advance", ray.get(engine.weight_version.remote()) == 1
          and all(v == 1 for o in b for v in o["versions"]), str([o["versions"] for o in b][:2]))
    check("outputs change", [o["response_ids"] for o in a] != [o["response_ids"] for o in b],
          f"{[tok.decode(o['response_ids']) for o in a][:3]} -> {[tok.decode(o['response_ids']) for o in b][:3]}")
    gap1 = max_gap([o["logprobs"] for o in b],
                   ray.get(policy.logprobs.remote(prompts, [o["response_ids"] for o in b], 0.0)))
    check("v1 logprobs = perturbed HF", gap1 < args.tolerance, f"max gap {gap1:.4f}")

    # partial rollout: publish v2 while sampled requests run; tokens keep their versions
    long = [{"prompt_ids": p, "max_new_tokens": 48, "temperature": 1.0} for p in prompts * 8]
    ref = engine.generate.remote(long)
    time.sleep(0.05)
    ray.get(policy.perturb.remote(seed=2, scale=0.1))
    mesh.publish(2)
    c = ray.get(ref)
    mixed = sum(1 for o in c if len(set(o["versions"])) > 1)
    ordered = all(o["versions"] == sorted(o["versions"]) for o in c)
    check("partial rollout versions ordered", ordered, f"{mixed} of {len(c)} samples span v1 and v2")

    ref = engine.generate.remote([{**r, "max_new_tokens": 48, "temperature": 1.0} for r in long])
    threading.Event().wait(0.05)
    ray.get(engine.abort_all.remote())
    d = ray.get(ref)
    statuses = sorted({o["status"] for o in d})
    check("abort_all", "aborted" in statuses, f"statuses {statuses}")
    ray.get(engine.close.remote())
    mesh.close()
    ray.shutdown()
    width = max(len(n) for n, _, _ in table)
    print(f"\n{'check':<{width}}  result  seen")
    for name, ok, detail in table:
        print(f"{name:<{width}}  {'PASS' if ok else 'FAIL':<6}  {detail}")
    failures = [n for n, ok, _ in table if not ok]
    print("sglang_check:", "OK" if not failures else f"FAILED {failures}")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
