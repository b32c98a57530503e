"""Teacher swapping: swap latency and bytes/s, then K teachers under a budget vs all resident.

    python benchmarks/teachers.py                       # 4 teachers, budget 2, ~130 MB each
    python benchmarks/teachers.py --hidden 1024 --layers 12   # bigger teachers (~600 MB each)

Part 1 (one process, budget 1): every acquire swaps a teacher in from its safetensors file
(evicting the other); prints per-swap latency and bytes/s.
Part 2 (one fresh process per setting, so peak RSS is the setting's own): a scoring stage
with K teachers, a batch holding rows of every teacher, rows batched by teacher. Prints
peak RSS (OS-measured, VmHWM), swaps per batch and scoring throughput for `--budget`
resident vs all K resident. The process runs with a fixed glibc mmap threshold so freed
weights go back to the OS (the adaptive threshold would keep them in the heap and hide
what eviction saves).
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path[0] = str(ROOT)     # the repository first; not this folder (its transfer.py names the package)


def make_teachers(root: Path, k: int, hidden: int, layers: int) -> dict[str, str]:
    """K random teachers on the shared vocabulary (weights' values do not matter for timing)."""
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM

    from stages.tasks.make_teacher import shared_tokenizer

    tok = shared_tokenizer()
    dirs = {}
    for i in range(k):
        d = root / f"t{i}"
        dirs[f"t{i}"] = str(d)
        if (d / "model.safetensors").is_file():
            continue
        torch.manual_seed(i)
        cfg = Qwen2Config(vocab_size=len(tok), hidden_size=hidden, intermediate_size=4 * hidden,
                          num_hidden_layers=layers, num_attention_heads=8, num_key_value_heads=2,
                          max_position_embeddings=64, tie_word_embeddings=True, pad_token_id=tok.pad_token_id,
                          eos_token_id=tok.eos_token_id, bos_token_id=tok.bos_token_id)
        Qwen2ForCausalLM(cfg).save_pretrained(d)
        tok.save_pretrained(d)
    return dirs


def rss() -> int:
    return int(open("/proc/self/statm").read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def peak_rss() -> int:
    """This process's RSS high-water mark. VmHWM, not ru_maxrss: Linux carries ru_maxrss over
    exec from the (v)forked parent, so a child would report the parent's peak."""
    line = next(x for x in open("/proc/self/status") if x.startswith("VmHWM:"))
    return int(line.split()[1]) * 1024


def swap_latency(dirs: dict[str, str], swaps: int, threads: int) -> dict:
    import torch

    from stages.teacher import TeacherConfig, TeacherManager

    torch.set_num_threads(threads)
    mgr = TeacherManager(TeacherConfig(teachers=dirs, max_resident=1), dirs["t0"])
    ids = list(dirs)
    lat = []
    for i in range(swaps + 1):
        _, s = mgr.acquire(ids[i % len(ids)])
        if i:                 # the first acquire evicts nothing; keep like with like
            lat.append(s.seconds)
    st = mgr.stats
    return {"bytes_per_teacher": mgr.specs["t0"].nbytes, "swaps": len(lat), "median_s": statistics.median(lat),
            "max_s": max(lat), "bytes_per_s_in": st.bytes_in / st.seconds_in, "evict_s_total": st.seconds_out}


def scoring_child(dirs: dict[str, str], budget: int, rows_per_teacher: int, batches: int, threads: int) -> dict:
    """Runs in a fresh process: peak RSS and rows/s of the scoring stage at one budget."""
    import numpy as np

    from stages.schema import table_from_columns
    from stages.teacher import TeacherConfig, TeacherScoring

    cfg = TeacherConfig(teachers=dirs, routes={t: t for t in dirs}, max_resident=budget, micro_batch=64)
    stage = TeacherScoring(cfg, dirs["t0"], num_threads=threads)
    base = rss()     # every teacher built and offloaded: what residency adds is measured from here
    g = np.random.default_rng(0)
    n = rows_per_teacher * len(dirs)
    table = table_from_columns({
        "data_source": [list(dirs)[i % len(dirs)] for i in range(n)],     # sources interleaved, as a stream mixes them
        "prompt_ids": [g.integers(3, 17, 6).tolist() for _ in range(n)],
        "response_ids": [g.integers(3, 17, 6).tolist() for _ in range(n)],
        "status": ["completed"] * n, "error": [""] * n})
    stage(table)                                   # warm: the steady state is what a long run sees
    s0 = stage.manager.stats.swaps_in
    t0 = time.perf_counter()
    for _ in range(batches):
        out = stage(table)
    dt = time.perf_counter() - t0
    assert out.column("status").to_pylist() == ["completed"] * n
    return {"budget": budget, "rows_per_s": batches * n / dt, "swaps_per_batch": (stage.manager.stats.swaps_in - s0)
            / batches, "peak_rss": peak_rss(), "base_rss": base,
            "peak_resident_bytes": stage.manager.stats.peak_resident_bytes, "end_rss": rss()}


def run_child(dirs, budget, args) -> dict:
    env = os.environ | {"MALLOC_MMAP_THRESHOLD_": "131072", "PYTHONPATH": str(ROOT)}
    cmd = [sys.executable, __file__, "--child", json.dumps(dirs), "--budget", str(budget),
           "--rows-per-teacher", str(args.rows_per_teacher), "--batches", str(args.batches),
           "--threads", str(args.threads)]
    out = subprocess.run(cmd, env=env, capture_output=True, text=True)
    if out.returncode:
        raise SystemExit(out.stderr[-3000:])
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--teachers", type=int, default=4)
    p.add_argument("--budget", type=int, default=2)
    p.add_argument("--hidden", type=int, default=512)
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--rows-per-teacher", type=int, default=32)
    p.add_argument("--batches", type=int, default=3)
    p.add_argument("--swaps", type=int, default=8)
    # 1 thread by default: on a shared, oversubscribed host, intra-op threads waiting on each other
    # turn a few-ms weight copy into hundreds of ms; raise it on a quiet machine
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--dir", default="", help="where the teachers are written (default: a temp dir)")
    p.add_argument("--child", default="", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.child:
        print(json.dumps(scoring_child(json.loads(args.child), args.budget, args.rows_per_teacher, args.batches,
                                       args.threads)))
        return
    with tempfile.TemporaryDirectory() as tmp:
        dirs = make_teachers(Path(args.dir or tmp), args.teachers, args.hidden, args.layers)
        lat = swap_latency(dirs, args.swaps, args.threads)
        mb = lat["bytes_per_teacher"] / 2**20
        print(f"teachers: {args.teachers} x {mb:.1f} MiB (hidden {args.hidden}, {args.layers} layers, float32)")
        print(f"swap-in (evict LRU + read safetensors into RAM), {lat['swaps']} swaps: "
              f"median {lat['median_s'] * 1e3:.1f} ms, max {lat['max_s'] * 1e3:.1f} ms, "
              f"{lat['bytes_per_s_in'] / 2**30:.2f} GiB/s; "
              f"evictions took {lat['evict_s_total'] * 1e3:.2f} ms in all")
        res = {b: run_child(dirs, b, args) for b in (args.budget, args.teachers)}
        lo, hi = res[args.budget], res[args.teachers]
        for r in (lo, hi):
            print(f"budget {r['budget']}/{args.teachers}: peak RSS {r['peak_rss'] / 2**20:.0f} MiB (all offloaded "
                  f"{r['base_rss'] / 2**20:.0f} MiB, at the end {r['end_rss'] / 2**20:.0f} MiB), "
                  f"{r['swaps_per_batch']:.1f} swaps/batch, "
                  f"{r['rows_per_s']:.1f} rows/s")
        share = (lo["peak_rss"] - lo["base_rss"]) / (hi["peak_rss"] - hi["base_rss"])
        print(f"peak RSS: {lo['peak_rss'] / hi['peak_rss']:.0%} of all-resident "
              f"({share:.0%} counting only what residency adds over all-offloaded); "
              f"throughput: {lo['rows_per_s'] / hi['rows_per_s']:.0%} of all-resident")


if __name__ == "__main__":
    main()
