"""How well the harness tier's warmed Codex answer holds for tool outputs it was not taught on.

    python benchmarks/harness_warm.py [--fixed N] [--unseen 60] [--seed 0]

Workload: what `tests/harness/test_harnesses.py::test_harness_tool_loop[codex]` does before it runs Codex —
serve `builtin:qwen-vocab-tiny` greedily, capture Codex's real first prompt through the proxy, warm the
model (stages/tasks/harness_sft.py) to call exec_command and then answer after the command's result — and
then, instead of one real run (whose result carries a random chunk id and wall time), decode the greedy
answer after `--unseen` more such results drawn by `--seed` and count the exact answers. The warm is the
test's (tests/harness/harnesses.py CODEX_OUTPUTS, CODEX_POOL, CODEX_HELD) and is cached as the test caches
it; `--fixed N` instead teaches N fixed results drawn by the seed, with no pool and no held-out check (the
tier taught two before).
Needs the harness CLIs (`tests/harness/install.sh`).
"""
from __future__ import annotations

import argparse
import random
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--fixed", type=int, default=0, help="teach N fixed outputs only (0: the test's warm)")
    ap.add_argument("--unseen", type=int, default=60)
    ap.add_argument("--seed", type=int, default=1)
    args = ap.parse_args()

    import ray
    import torch

    import tests.harness.test_harnesses as T
    from pipeline.serve import Server, serve_config
    from stages.model import load_model
    from stages.tasks.harness_sft import call_json, examples
    from tests.harness import harnesses as H

    cfg = serve_config("builtin:qwen-vocab-tiny", ["sampling.max_new_tokens=96", "sampling.temperature=0",
                                                   "proxy.force_sampling=true", "engine.threads=1"], None, None)
    srv = Server(cfg, Path(tempfile.mkdtemp()), keep_engine_calls=True).start()
    try:
        h = H.ALL["codex"]
        prompt = T._capture(h, srv, T._home("codex"))
        call = call_json(h.tool, h.args(f"echo {H.OUTPUT}"))
        rng = random.Random(args.seed + 1000)
        taught = tuple(H.codex_output(rng) for _ in range(args.fixed)) if args.fixed else h.outputs
        more = {} if args.fixed else {k: examples(srv.tok, prompt, call, h.answer, H.OUTPUT, getattr(h, k))[1:]
                                      for k in ("pool", "held")}
        state = T._teach_cached(srv.model_path, examples(srv.tok, prompt, call, h.answer, H.OUTPUT, taught),
                                windows=(256, 1024, max(2048, len(prompt))), **more,
                                **({} if args.fixed else {"per_step": 4}))
    finally:
        srv.stop()
        ray.shutdown()
    model = load_model(srv.model_path)
    model.load_state_dict(state)
    rng = random.Random(args.seed)
    unseen = examples(srv.tok, prompt, call, h.answer, H.OUTPUT,
                      tuple(H.codex_output(rng) for _ in range(args.unseen)))[1:]
    right = 0
    with torch.no_grad():
        for p, target in unseen:
            ids, out = list(p), []
            while len(out) < len(target) + 3 and (not out or out[-1] != target[-1]):
                out.append(int(model(input_ids=torch.tensor([ids])).logits[0, -1].argmax()))
                ids.append(out[-1])
            right += out == target
            if out != target:
                print(f"  wrong: {srv.tok.decode(out)!r}")
    print(f"codex answer after unseen tool outputs: {right} of {len(unseen)} exact "
          f"({'fixed ' + str(args.fixed) if args.fixed else 'the test warm'}, seed {args.seed})")


if __name__ == "__main__":
    main()
