"""Built-in models: the tiny Qwen2 policy of a built-in task, and named ones (`model.path: builtin:NAME`).

With `model.path` empty the project builds its own tiny Qwen2 policy for a built-in task
(character tokenizer, briefly SFT-warmed so RL has signal) and caches it on disk keyed by
every setting that shapes it: the second run loads it in a second.
"""
from __future__ import annotations

import hashlib
import json
import os
from dataclasses import asdict
from pathlib import Path

import torch

from stages.model_config import ModelConfig, attention_heads, cached_model_dir

SPECIAL = ["<pad>", "<eos>", "<bos>"]
def build_char_tokenizer(chars: str):
    """Character-level fast tokenizer: <pad>=0, <eos>=1, <bos>=2, then `chars` in order."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {t: i for i, t in enumerate(SPECIAL + list(dict.fromkeys(chars)))}
    core = Tokenizer(models.WordLevel(vocab=vocab, unk_token=None))
    core.pre_tokenizer = pre_tokenizers.Split("", behavior="isolated")
    core.decoder = decoders.Fuse()
    tok = PreTrainedTokenizerFast(tokenizer_object=core, pad_token="<pad>", eos_token="<eos>", bos_token="<bos>")
    tok.padding_side = "left"
    return tok


def tiny_model_dir(cfg: ModelConfig, log=print) -> str:
    """The built-in task's tiny policy (model.path ""), built on first use into model.cache_dir."""
    key = {k: v for k, v in asdict(cfg).items() if k not in ("path", "cache_dir")}
    if attention_heads(cfg.hidden_size)[0] != 4:     # narrower than 128: no longer 4 heads of 16 (their old caches)
        key["heads"] = attention_heads(cfg.hidden_size)
    digest = hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:12]
    out = Path(os.path.expanduser(cfg.cache_dir)) / f"tiny-{cfg.builtin_task}-{digest}"
    return cached_model_dir(out, lambda tmp: build_tiny_model(cfg, tmp, log=log),
                            f"the built-in tiny model for task {cfg.builtin_task!r}", log)


def tiny_qwen2(tok, hidden_size: int, num_layers: int, heads: tuple[int, int], context: int = 64):
    """A random fp32 Qwen2ForCausalLM with tied embeddings on `tok`'s vocabulary: a built-in policy's architecture."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    return Qwen2ForCausalLM(Qwen2Config(
        vocab_size=len(tok), hidden_size=hidden_size, intermediate_size=4 * hidden_size,
        num_hidden_layers=num_layers, num_attention_heads=heads[0], num_key_value_heads=heads[1],
        max_position_embeddings=context, tie_word_embeddings=True, pad_token_id=tok.pad_token_id,
        eos_token_id=tok.eos_token_id, bos_token_id=tok.bos_token_id, dtype="float32"))


def builtin_model_dir(name: str, cache_dir: str, log=print) -> str:
    """`model.path: builtin:NAME`: a named built-in model, built once into cache_dir.
    qwen-vocab-tiny: a random tiny Qwen2 on Qwen's real vocabulary and a think-dropping chat
    template (stages/tasks/qwen_vocab.py), for token-exactness checks; it does not learn.
    qwen-vocab-tiny-32k: the same with 32,768 positions, for agent-length prompts."""
    from stages.tasks import qwen_vocab

    builders = {qwen_vocab.NAME: qwen_vocab.qwen_tiny_model_dir,
                qwen_vocab.NAME_32K: qwen_vocab.qwen_tiny_32k_model_dir}
    if name not in builders:
        raise ValueError(f"model.path 'builtin:{name}': no such built-in model (known: {', '.join(sorted(builders))})")
    return builders[name](cache_dir, log=log)


def build_tiny_model(cfg: ModelConfig, out: Path, log=print) -> None:
    from stages.tasks import get_task
    from stages.tasks.sft import sft

    task = get_task(cfg.builtin_task, digits=cfg.builtin_digits)
    tok = build_char_tokenizer(task.vocab)
    torch.manual_seed(cfg.seed)
    model = tiny_qwen2(tok, cfg.hidden_size, cfg.num_layers, attention_heads(cfg.hidden_size),
                       getattr(task, "context", 64))     # 64 tokens, or what a multi-turn task asks
    rows = task.make_rows("train", cfg.warmup_rows, seed=cfg.seed)
    if hasattr(task, "demonstration"):   # multi-turn demonstrations (e.g. calculator calls), not bare answers
        rows = [r | {"demo": task.demonstration(r)} for r in rows]
    stats = sft(model, tok, rows, steps=cfg.warmup_steps, lr=cfg.warmup_lr, seed=cfg.seed + 1,
                label_smoothing=cfg.warmup_label_smoothing, log=log)
    log(f"built-in model warmed: final SFT loss {stats['loss']:.3f} in {stats['seconds']:.1f}s")
    model.save_pretrained(out)
    tok.save_pretrained(out)
