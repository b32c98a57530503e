"""Log-probs and entropy on response positions only, chunked: the same numbers and gradients as
the full [B, L, V] computation they replace (trainer, teacher scorer)."""
from __future__ import annotations

import dataclasses

import pyarrow as pa
import pytest
import torch

from stages.lora import LoraConfig
from stages.token_logprobs import split_model, token_stats
from stages.update.losses import AlgorithmConfig
from stages.update.step import to_batch
from stages.update.trainer import TorchTrainer, TrainerConfig


def _table(n_groups: int = 3, per: int = 3, seed: int = 0) -> pa.Table:
    """Groups of rows sharing a prompt, ragged prompts and responses, one failed row."""
    g = torch.Generator().manual_seed(seed)
    rows = []
    for grp in range(n_groups):
        prompt = torch.randint(3, 14, (4 + 3 * grp,), generator=g).tolist()
        for i in range(per):
            k = 2 + (i * 5 + grp) % 7
            resp = torch.randint(3, 14, (k,), generator=g).tolist()
            rows.append({"prompt_ids": prompt, "response_ids": resp, "response_logprobs": [-1.0] * k,
                         "loss_mask": [1] * k, "token_versions": [0] * k, "reward": float((i + grp) % 2),
                         "group_id": grp, "status": "failed" if (grp, i) == (1, 2) else "completed"})
    return pa.Table.from_pylist(rows)


def _full(model, b, temperature, topk_ids):
    """Today's computation: the whole [B, L, V] logits, then the response positions."""
    out = model(input_ids=b.input_ids, attention_mask=b.attn, use_cache=False).logits.float() / temperature
    logp = torch.log_softmax(out.gather(1, b.resp_pos[..., None].expand(-1, -1, out.shape[-1])), -1)
    return (logp.gather(-1, b.resp_ids[..., None])[..., 0], -(logp.exp() * logp).sum(-1), logp.gather(-1, topk_ids))


@pytest.mark.parametrize("share,chunk,lora", [(False, 0, False), (False, 3, False), (True, 5, False),
                                              (True, 1, True), (False, 4, True)])
def test_chunked_response_logprobs_entropy_and_gradients_equal_the_full_computation(raw_model_dir, share, chunk,
                                                                                     lora):
    cfg = TrainerConfig(num_threads=1, share_prompts=share, logprob_chunk=chunk,
                        lora=LoraConfig(enabled=lora, rank=4, target_modules=("q_proj", "v_proj", "down_proj")))
    tr = TorchTrainer(raw_model_dir, cfg, AlgorithmConfig(), temperature=0.7)
    if lora:        # LoRA's B starts at 0: move it, so the adapter is in the numbers being compared
        with torch.no_grad():
            for p in tr.params:
                p.normal_(0, 0.05)
    b = to_batch(_table(), tr.pad_id)
    real = torch.arange(b.resp_ids.shape[1])[None, :] < b.lengths[:, None]
    topk = torch.randint(0, tr.model.config.vocab_size, (*b.resp_ids.shape, 3))
    got, want = {}, {}
    for name, fn in (("chunked", lambda: tr.logprobs(tr.model, b, with_entropy=True, topk_ids=topk)),
                     ("full", lambda: _full(tr.model, b, 0.7, topk))):
        tr.model.zero_grad(set_to_none=True)
        lp, ent, top = fn()
        w = torch.linspace(0.5, 1.5, lp.numel()).reshape(lp.shape) * real   # any weighting of real tokens
        ((lp * w).sum() + 0.3 * (ent * w).sum() + 0.1 * (top * w[..., None]).sum()).backward()
        (got if name == "chunked" else want)["v"] = [x * real[..., None] if x.dim() == 3 else x * real
                                                      for x in (lp, ent, top)]
        (got if name == "chunked" else want)["g"] = {n: p.grad.clone() for n, p in tr.model.named_parameters()
                                                     if p.grad is not None}
    for a, e in zip(got["v"], want["v"]):
        torch.testing.assert_close(a, e, rtol=1e-5, atol=2e-5)
    assert got["g"].keys() == want["g"].keys() and got["g"]
    for n, g in want["g"].items():
        torch.testing.assert_close(got["g"][n], g, rtol=1e-4, atol=1e-5, msg=n)


def test_token_stats_chunks_give_one_result_and_top_k(raw_model_dir):
    tr = TorchTrainer(raw_model_dir, TrainerConfig(num_threads=1), AlgorithmConfig())
    decoder, head = split_model(tr.model)
    h = torch.randn(11, tr.model.config.hidden_size, requires_grad=True)
    tgt = torch.randint(0, tr.model.config.vocab_size, (11,))
    outs = [token_stats(h, head, tgt, 1.3, chunk, entropy=True, top_k=4) for chunk in (0, 1, 4, 11, 50)]
    for o in outs[1:]:
        for f in dataclasses.fields(o):
            torch.testing.assert_close(getattr(o, f.name), getattr(outs[0], f.name), rtol=1e-6, atol=1e-6)
    grads = []
    for o in outs[:3]:
        h.grad = None
        (o.logprobs.sum() + o.entropy.sum()).backward(retain_graph=True)
        grads.append(h.grad.clone())
    torch.testing.assert_close(grads[1], grads[0])
    torch.testing.assert_close(grads[2], grads[0])
    empty = token_stats(h[:0], head, tgt[:0], 1.0, 4, entropy=True)
    assert empty.logprobs.shape == (0,) and empty.entropy.shape == (0,)


def test_a_model_whose_logits_are_not_the_head_of_its_states_takes_the_full_path(raw_model_dir):
    from stages.model import load_model

    model = load_model(raw_model_dir)
    assert split_model(model) is not None
    odd = load_model(raw_model_dir)
    plain = odd.forward

    def scaled(*a, **kw):       # a logit scale applied after the head, as some architectures do
        out = plain(*a, **kw)
        out.logits = out.logits * 2
        return out

    odd.forward = scaled
    assert split_model(odd) is None          # checked once, remembered
    assert split_model(odd) is None


def test_no_tensor_spans_sequence_by_vocabulary(tmp_path):
    """A 600-token prompt on a 50k vocabulary: the full logits would be 2 x 600 x 50k. The largest
    tensor any op makes in the forward and backward of the chunked path is far below that."""
    from torch.utils._python_dispatch import TorchDispatchMode
    from transformers import Qwen2Config, Qwen2ForCausalLM

    V, L = 50_000, 600
    torch.manual_seed(0)
    Qwen2ForCausalLM(Qwen2Config(vocab_size=V, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                                 num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=1024,
                                 tie_word_embeddings=True, pad_token_id=0)).save_pretrained(tmp_path)
    rows = [{"prompt_ids": torch.randint(1, V, (L,)).tolist(), "response_ids": torch.randint(1, V, (8,)).tolist(),
             "response_logprobs": [-1.0] * 8, "loss_mask": [1] * 8, "token_versions": [0] * 8, "reward": float(i),
             "group_id": 0, "status": "completed"} for i in range(2)]
    tr = TorchTrainer(str(tmp_path), TrainerConfig(num_threads=1, logprob_chunk=4), AlgorithmConfig())
    b = to_batch(pa.Table.from_pylist(rows), tr.pad_id)

    class Largest(TorchDispatchMode):
        numel = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            for t in out if isinstance(out, (tuple, list)) else (out,):
                if isinstance(t, torch.Tensor):
                    Largest.numel = max(Largest.numel, t.numel())
            return out

    with Largest():
        lp, ent, _ = tr.logprobs(tr.model, b, with_entropy=True)
        (lp.sum() + ent.sum()).backward()
    assert lp.shape == (2, 8) and torch.isfinite(lp).all()
    assert Largest.numel <= V * 16          # the embedding (and its gradient): V x hidden
    assert Largest.numel < 2 * L * V / 50   # the full logits would be 2 x L x V
