"""HF <-> Megatron-core weights for Qwen2 / Llama causal LMs, with tensor-parallel sharding.

Megatron's GPT layers fuse what HF keeps apart: q, k, v into linear_qkv by KV group (a TP rank holds
n_kv/tp whole groups, so its heads need no communication), gate and up into linear_fc1 (megatron's glu
takes the first half as the gate). Each is split across TP ranks along the dimension it is parallel in;
the vocabulary is padded with zero rows to a multiple of tp (its logits masked, logprobs.py). Both
directions are pure copies and reshapes, so a round trip is bit-exact. The names are those of
megatron's local layer spec (get_gpt_layer_local_spec).
"""
from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Callable, Mapping

import torch

SUPPORTED = ("qwen2", "llama")


@dataclass(frozen=True)
class Arch:
    """The shape facts of an HF Qwen2/Llama config that the mapping needs."""
    num_layers: int
    hidden: int
    ffn: int
    heads: int
    kv_heads: int
    head_dim: int
    vocab: int
    tied: bool
    qkv_bias: bool
    eps: float
    rope_theta: float
    rope_llama3_factor: float      # 0 = plain RoPE; else llama3 frequency scaling with this factor
    max_positions: int

    @classmethod
    def from_hf(cls, cfg) -> "Arch":
        if cfg.model_type not in SUPPORTED:
            raise ValueError(f"megatron backend supports model types {SUPPORTED}, got {cfg.model_type!r}")
        if cfg.model_type == "llama" and (getattr(cfg, "attention_bias", False) or getattr(cfg, "mlp_bias", False)):
            raise ValueError("llama with attention_bias/mlp_bias is not supported by the megatron mapping")
        rope = dict(getattr(cfg, "rope_parameters", None) or getattr(cfg, "rope_scaling", None) or {})
        theta = rope.get("rope_theta", getattr(cfg, "rope_theta", 10000.0))
        kind = rope.get("rope_type", rope.get("type", "default"))
        factor = 0.0
        if kind == "llama3":
            # megatron implements llama3 scaling with these constants only
            fixed = {"low_freq_factor": 1.0, "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}
            if any(float(rope.get(k, v)) != v for k, v in fixed.items()):
                raise ValueError(f"llama3 rope scaling with {rope} differs from megatron's fixed constants {fixed}")
            factor = float(rope["factor"])
        elif kind != "default":
            raise ValueError(f"rope type {kind!r} is not supported by the megatron backend (default, llama3 are)")
        heads = cfg.num_attention_heads
        return cls(num_layers=cfg.num_hidden_layers, hidden=cfg.hidden_size, ffn=cfg.intermediate_size,
                   heads=heads, kv_heads=cfg.num_key_value_heads or heads,
                   head_dim=getattr(cfg, "head_dim", None) or cfg.hidden_size // heads,
                   vocab=cfg.vocab_size, tied=bool(cfg.tie_word_embeddings),
                   qkv_bias=cfg.model_type == "qwen2", eps=cfg.rms_norm_eps, rope_theta=float(theta),
                   rope_llama3_factor=factor, max_positions=cfg.max_position_embeddings)

    def padded_vocab(self, tp: int) -> int:
        return -(-self.vocab // tp) * tp

    def check_tp(self, tp: int) -> None:
        if self.kv_heads % tp or self.heads % tp or self.ffn % tp:
            raise ValueError(f"tensor_parallel={tp} must divide kv heads ({self.kv_heads}), heads "
                             f"({self.heads}) and the MLP width ({self.ffn})")


# ---- one layout per kind of parameter: shard(hf tensors, arch, rank, tp) -> this rank's tensor, and
# merge(every rank's tensor, arch) -> the HF tensors

@dataclass(frozen=True)
class Layout:
    shard: Callable
    merge: Callable


def _pad_vocab(w: torch.Tensor, arch: Arch, tp: int) -> torch.Tensor:
    pad = arch.padded_vocab(tp) - w.shape[0]
    return torch.cat([w, w.new_zeros(pad, *w.shape[1:])]) if pad else w


def _qkv_groups(q, k, v, arch: Arch) -> torch.Tensor:
    """Per KV group: its query heads, its key head, its value head (weights or biases)."""
    g, d, tail = arch.heads // arch.kv_heads, arch.head_dim, q.shape[1:]    # tail: (hidden,) or ()
    return torch.cat([q.reshape(arch.kv_heads, g * d, *tail), k.reshape(arch.kv_heads, d, *tail),
                      v.reshape(arch.kv_heads, d, *tail)], dim=1)


def _qkv_merge(shards, arch: Arch) -> list[torch.Tensor]:
    g, d, tail = arch.heads // arch.kv_heads, arch.head_dim, shards[0].shape[1:]
    groups = torch.cat([s.reshape(-1, (g + 2) * d, *tail) for s in shards], dim=0)
    return [x.reshape(-1, *tail).clone() for x in groups.split([g * d, d, d], dim=1)]


Replicated = Layout(lambda hf, arch, rank, tp: hf[0].clone(), lambda shards, arch: [shards[0].clone()])
RowParallel = Layout(lambda hf, arch, rank, tp: hf[0].chunk(tp, dim=1)[rank].clone(),    # split along the input
                     lambda shards, arch: [torch.cat(shards, dim=1)])
VocabParallel = Layout(lambda hf, arch, rank, tp: _pad_vocab(hf[0], arch, tp).chunk(tp, dim=0)[rank].clone(),
                       lambda shards, arch: [torch.cat(shards, dim=0)[: arch.vocab].clone()])
GatedFc1 = Layout(   # [gate; up] per rank: each rank's slice of gate, then its slice of up
    lambda hf, arch, rank, tp: torch.cat([hf[0].chunk(tp, dim=0)[rank], hf[1].chunk(tp, dim=0)[rank]], dim=0),
    lambda shards, arch: [torch.cat([s.chunk(2, dim=0)[h] for s in shards]) for h in (0, 1)])
FusedQKV = Layout(lambda hf, arch, rank, tp: _qkv_groups(*hf, arch).chunk(tp, dim=0)[rank].reshape(
    -1, *hf[0].shape[1:]).clone(), _qkv_merge)


# megatron name (per layer, after "decoder.layers.{i}.") -> (HF names after "model.layers.{i}.", layout)
LAYER = {
    "input_layernorm.weight": (("input_layernorm.weight",), Replicated),
    "self_attention.linear_qkv.weight": (("self_attn.q_proj.weight", "self_attn.k_proj.weight",
                                          "self_attn.v_proj.weight"), FusedQKV),
    "self_attention.linear_qkv.bias": (("self_attn.q_proj.bias", "self_attn.k_proj.bias",
                                        "self_attn.v_proj.bias"), FusedQKV),
    "self_attention.linear_proj.weight": (("self_attn.o_proj.weight",), RowParallel),
    "pre_mlp_layernorm.weight": (("post_attention_layernorm.weight",), Replicated),
    "mlp.linear_fc1.weight": (("mlp.gate_proj.weight", "mlp.up_proj.weight"), GatedFc1),
    "mlp.linear_fc2.weight": (("mlp.down_proj.weight",), RowParallel),
}
GLOBAL = {
    "embedding.word_embeddings.weight": (("model.embed_tokens.weight",), VocabParallel),
    "decoder.final_layernorm.weight": (("model.norm.weight",), Replicated),
    "output_layer.weight": (("lm_head.weight",), VocabParallel),
}
_LAYER_NAME = re.compile(r"^decoder\.layers\.(\d+)\.(.+)$")


def rule(name: str, arch: Arch, layer_index: Callable[[int], int] = lambda i: i):
    """(HF names, layout) of one megatron parameter. layer_index maps a stage-local layer
    index to the global one (pipeline stages number their layers from 0)."""
    m = _LAYER_NAME.match(name)
    if m:
        hf, layout = LAYER[m.group(2)]
        i = layer_index(int(m.group(1)))
        return tuple(f"model.layers.{i}.{n}" for n in hf), layout
    hf, layout = GLOBAL[name]
    if name == "output_layer.weight" and arch.tied:
        hf = ("model.embed_tokens.weight",)     # a last pipeline stage keeps its own copy of the tied embedding
    return hf, layout


def to_megatron(names: list[str], get_hf: Callable[[str], torch.Tensor], arch: Arch, rank: int = 0, tp: int = 1,
                layer_index: Callable[[int], int] = lambda i: i) -> dict[str, torch.Tensor]:
    """This TP rank's tensors for the megatron parameter `names`, read through `get_hf`."""
    out = {}
    for name in names:
        hf, layout = rule(name, arch, layer_index)
        out[name] = layout.shard([get_hf(n) for n in hf], arch, rank, tp)
    return out


def to_hf(shards: list[Mapping[str, torch.Tensor]], arch: Arch,
          layer_index: Callable[[int], int] = lambda i: i) -> dict[str, torch.Tensor]:
    """Every TP rank's tensors merged into HF ones; a tied output layer is skipped (see hf_order)."""
    out = {}
    for name in shards[0]:
        if name == "output_layer.weight" and arch.tied:
            continue
        hf, layout = rule(name, arch, layer_index)
        out.update(zip(hf, layout.merge([s[name] for s in shards], arch)))
    return out


def hf_order(state: Mapping[str, torch.Tensor], arch: Arch) -> dict[str, torch.Tensor]:
    """HF's own state_dict order and keys (lm_head.weight is listed even when tied, as HF's
    state_dict does), so a receiver's specs match name for name."""
    layer = ("self_attn.q_proj.weight", "self_attn.q_proj.bias", "self_attn.k_proj.weight", "self_attn.k_proj.bias",
             "self_attn.v_proj.weight", "self_attn.v_proj.bias", "self_attn.o_proj.weight", "mlp.gate_proj.weight",
             "mlp.up_proj.weight", "mlp.down_proj.weight", "input_layernorm.weight", "post_attention_layernorm.weight")
    names = ["model.embed_tokens.weight"]
    names += [f"model.layers.{i}.{n}" for i in range(arch.num_layers) for n in layer]
    names += ["model.norm.weight", "lm_head.weight"]
    out = {n: state[n] for n in names if n in state}
    if arch.tied:
        out["lm_head.weight"] = out["model.embed_tokens.weight"]
    if missing := set(state) - set(out):
        raise KeyError(f"unmapped HF tensors: {sorted(missing)[:5]}")
    return out
