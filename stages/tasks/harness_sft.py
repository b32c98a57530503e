"""Warm a tiny Qwen-vocabulary model, by SFT in code, to drive one real harness through a tool loop.

Used by the harness recipes' warm-up (examples/agents/warm_harness.py) and the harness test tier
(tests/harness/): one piece of code for both.

The model must answer the harness's own first prompt (its system prompt, tools and our task, as
the proxy renders them) with ONE tool call in that harness's tool, and a prompt that ends with the
tool's result with a final answer. So: capture the harness's real first prompt (one short run
against the server), build the second prompt from it the way the chat template renders the
turns that follow, and train on both (loss on the answer tokens only, as stages/tasks/sft.py
does). Long prompts train on their last `window` tokens at their real positions (RoPE sees the
same offsets as at inference); a few windows of different widths make the learned cue (the
`<tool_response>` turn, or its absence) hold whatever precedes it. The trained weights are
loaded into the running engine (`load_weights`, as the TransferMesh does after a step).
"""
from __future__ import annotations

import json
import time
from collections import Counter

import torch

TOOL_OUTPUTS = ("{out}\n", '{{\n  "returncode": 0,\n  "output": "{out}\\n"\n}}',
                "Exit code: 0\nWall time: 0 seconds\nOutput:\n{out}\n")   # plain (most), mini-swe-agent, shell


def turn_texts(tok, call: dict | None, answer: str) -> tuple[str, str, str]:
    """(first reply, the text between it and the second reply's prompt end, second reply) as the chat
    template renders them; `call` = {"name", "arguments"} (None: the first reply is plain text)."""
    from stages.agentflow.chat import render

    tools = [{"type": "function", "function": {"name": (call or {}).get("name", "t"), "parameters": {}}}]
    u = [{"role": "user", "content": "x"}]
    a = {"role": "assistant", "content": ""}
    if call:
        a["tool_calls"] = [{"id": "c1", "type": "function", "function": call}]
    t = {"role": "tool", "tool_call_id": "c1", "content": "@@OUT@@"}
    A, B, C = render(tok, u, tools), render(tok, u + [a], tools, False), render(tok, u + [a, t], tools)
    assert B.startswith(A) and C.startswith(B), "the chat template is not append-only over a tool turn"
    first = B[len(A):]
    end = "<|im_end|>\n"
    assert first.endswith(end)
    return first[: -len(end)], end + C[len(B):], answer


def examples(tok, first_prompt: list[int], call: dict | None, answer: str, output: str, shapes=TOOL_OUTPUTS):
    """(prompt ids, target ids) pairs: the first prompt -> the tool call; that prompt + the call + each
    way a harness may show the tool's output (`shapes`) -> the answer. Targets end with <|im_end|> (eos)."""
    first, between, final = turn_texts(tok, call, answer)
    eos = tok.convert_tokens_to_ids("<|im_end|>")
    enc = lambda s: tok(s, add_special_tokens=False)["input_ids"]  # noqa: E731
    call_ids = enc(first)
    out = [(list(first_prompt), call_ids + [eos])]
    for shape in shapes:
        tail = between.replace("@@OUT@@", shape.format(out=output))
        out.append((list(first_prompt) + call_ids + enc(tail), enc(final) + [eos]))
    return out


def _loss(model, prompt: list[int], target: list[int], window: int, vocab: torch.Tensor) -> torch.Tensor:
    """Cross-entropy of the target over `vocab` (the target's ids and a sample of the rest: a sampled
    softmax; a full one over 151k ids costs most of a step, and the untrained rows stay small)."""
    ctx = prompt[-window:]
    ids = torch.tensor([ctx + target[:-1]])
    start = len(prompt) - len(ctx)
    pos = torch.arange(start, start + ids.shape[1])[None]
    hidden = model.model(input_ids=ids, position_ids=pos).last_hidden_state[0, len(ctx) - 1:]
    logits = hidden @ model.lm_head.weight[vocab].T
    labels = torch.searchsorted(vocab, torch.tensor(target))
    return torch.nn.functional.cross_entropy(logits, labels)


def _sample_vocab(pairs, size: int, n_vocab: int, gen: torch.Generator) -> torch.Tensor:
    if size <= 0:           # the full softmax: what sampling at inference sees (a sampled one leaves mass elsewhere)
        return torch.arange(n_vocab)
    need = torch.tensor(sorted({i for p, t in pairs for i in t + p[-64:]}))
    return torch.unique(torch.cat([need, torch.randint(0, n_vocab, (size,), generator=gen)]))


def teach(model_dir: str, pairs: list, steps: int = 300, lr: float = 1e-2, windows=(256, 1024, 2048),
          sample: int = 4096, full_steps: int = 0, threads: int = 1, pool: list = (), per_step: int = 0,
          held: list = (), log=print):
    """SFT the model at `model_dir` on (prompt, target) pairs until every target is its greedy answer
    (checked at the widest window), and so is every `held` pair's, which it never trains on, or `steps` run out;
    returns its state dict. `pool`: more pairs, `per_step` of them drawn anew each step (an input that varies per
    run, such as a tool's output holding a random id, is learnt from many examples, not a few by heart).
    `sample`: vocabulary ids in each step's softmax (0: all of them); the last `full_steps` steps use all of
    them, which takes the mass a sampled softmax leaves on the untrained ids (what sampling at temperature 1
    would find).
    `threads`: torch threads (1: measured 4.0 s a step against 20 s with 2 on the shared 2-core machine)."""
    from stages.model import load_model

    torch.manual_seed(0)
    torch.set_num_threads(threads)
    model = load_model(model_dir)
    model.train()
    opt = torch.optim.AdamW(model.parameters(), lr=lr, betas=(0.9, 0.98), weight_decay=0.0)
    gen = torch.Generator().manual_seed(0)
    n_vocab = model.lm_head.weight.shape[0]
    t0 = time.time()
    # a pair given k times weighs k (a deliberately uneven mix of demonstrations), computed once
    weights = Counter((tuple(p), tuple(t)) for p, t in pairs)
    for step in range(steps):
        opt.zero_grad(set_to_none=True)
        total = 0.0
        drawn = [pool[i] for i in torch.randperm(len(pool), generator=gen)[:per_step].tolist()] if pool else []
        items = list(weights.items()) + [((tuple(p), tuple(t)), 1) for p, t in drawn]
        vocab = _sample_vocab(list(pairs) + drawn, 0 if step >= steps - full_steps else sample, n_vocab, gen)
        for (p, t), k in items:
            w = windows[step % len(windows)]
            loss = _loss(model, list(p), list(t), w, vocab) * (k / (len(pairs) + len(drawn)))
            loss.backward()
            total += loss.item()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        if step % 10 == 9:
            log(f"warm step {step + 1}: loss {total:.4f} ({time.time() - t0:.0f}s)", flush=True)
            if total < 0.05 and _greedy_ok(model, list(pairs) + list(held), max(windows)):
                break
    model.eval()
    log(f"warmed in {step + 1} steps, {time.time() - t0:.1f}s, loss {total:.4f}", flush=True)
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


@torch.no_grad()
def sequence_probability(model, prompt: list[int], target: list[int], temperature: float = 1.0) -> float:
    """P(a sample at `temperature` from the full softmax is exactly `target`), the whole prompt as context."""
    ids = torch.tensor([prompt + target[:-1]])
    hidden = model.model(input_ids=ids).last_hidden_state[0, len(prompt) - 1:]
    logp = torch.log_softmax(model.lm_head(hidden).float() / temperature, -1)
    return float(logp[torch.arange(len(target)), torch.tensor(target)].sum().exp())


@torch.no_grad()
def _greedy_ok(model, pairs, window: int) -> bool:
    for p, t in pairs:
        ctx = p[-window:]
        ids = torch.tensor([ctx + t[:-1]])
        start = len(p) - len(ctx)
        pos = torch.arange(start, start + ids.shape[1])[None]
        hidden = model.model(input_ids=ids, position_ids=pos).last_hidden_state[0, len(ctx) - 1:]
        if model.lm_head(hidden).argmax(-1).tolist() != t:
            return False
    return True


def main_prompt(tok, prompts: list[list[int]]) -> list[int]:
    """The harness's main prompt among the prompts of its first calls: the first that offers the tools. A side
    call (opencode's title) offers none, and a later call is the harness's reaction to the untrained model's
    reply (Claude Code asks again for "visible output"), a prompt no run sends first."""
    main = [p for p in prompts if "<tools>" in tok.decode(p[:4096])]
    return main[0] if main else prompts[0]


def call_json(name: str, arguments: dict) -> dict:
    """A tool call as the chat template takes it (arguments as an object: rendered with json.dumps)."""
    return {"name": name, "arguments": json.loads(json.dumps(arguments))}
