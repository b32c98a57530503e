"""Build a megatron-core GPTModel that computes what an HF Qwen2/Llama computes. Dropout is off: RL
fine-tuning runs without it, and it keeps the trainer's log-probs those of the policy the engine samples.
"""
from __future__ import annotations

import torch

from stages.model import DTYPES

from .convert import Arch


def transformer_config(arch: Arch, tp: int, pp: int, dtype: str, on_cpu: bool, recompute: bool = False):
    from megatron.core.transformer.transformer_config import TransformerConfig

    arch.check_tp(tp)
    if arch.num_layers % pp:
        raise ValueError(f"pipeline_parallel={pp} must divide the layer count {arch.num_layers}")
    params_dtype = DTYPES[dtype]
    extra = dict(recompute_granularity="full", recompute_method="uniform", recompute_num_layers=1) if recompute else {}
    return TransformerConfig(
        num_layers=arch.num_layers, hidden_size=arch.hidden, ffn_hidden_size=arch.ffn,
        num_attention_heads=arch.heads, num_query_groups=arch.kv_heads, kv_channels=arch.head_dim,
        normalization="RMSNorm", layernorm_epsilon=arch.eps, gated_linear_unit=True,
        activation_func=torch.nn.functional.silu, add_bias_linear=False, add_qkv_bias=arch.qkv_bias,
        hidden_dropout=0.0, attention_dropout=0.0,
        tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp, pipeline_dtype=params_dtype,
        params_dtype=params_dtype, bf16=params_dtype is torch.bfloat16, fp16=params_dtype is torch.float16,
        # the unfused paths: the fused kernels need CUDA extensions, and these match HF's maths
        bias_dropout_fusion=False, apply_rope_fusion=False, masked_softmax_fusion=False,
        gradient_accumulation_fusion=False, persist_layer_norm=False,
        # Every weight is then overwritten from HF, but initialisation must run: it is what
        # tags the TP-split weights (tensor_model_parallel) that grad-norm clipping counts.
        use_cpu_initialization=on_cpu, perform_initialization=True,
        calculate_per_token_loss=True,   # the loss is normalised over the whole step, see trainer.py
        **extra,
    )


def build_gpt(arch: Arch, config, pre_process: bool, post_process: bool):
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec

    return GPTModel(
        config, get_gpt_layer_local_spec(normalization="RMSNorm"),
        vocab_size=arch.padded_vocab(config.tensor_model_parallel_size), max_sequence_length=arch.max_positions,
        pre_process=pre_process, post_process=post_process, parallel_output=True,
        share_embeddings_and_output_weights=arch.tied, position_embedding_type="rope",
        rotary_base=arch.rope_theta, rope_scaling=arch.rope_llama3_factor > 0,
        rope_scaling_factor=arch.rope_llama3_factor or 8.0,
    )


def layer_index(model):
    """Stage-local layer index -> global layer index (megatron numbers layers from 1)."""
    numbers = [layer.layer_number - 1 for layer in model.decoder.layers]
    return lambda i: numbers[i]


def hf_reader(path: str):
    """name -> that HF tensor, read from a model directory's safetensors files on demand, so a rank
    only ever holds the tensors it shards (not the whole checkpoint)."""
    import json
    from pathlib import Path

    from safetensors import safe_open

    index = Path(path) / "model.safetensors.index.json"
    files = set(json.loads(index.read_text())["weight_map"].values()) if index.is_file() else {"model.safetensors"}
    where = {name: h for h in [safe_open(str(Path(path) / f), framework="pt") for f in files] for name in h.keys()}
    return lambda name: where[name].get_tensor(name)
