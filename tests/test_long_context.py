"""Long contexts (docs/long-context.md): the embedded engine computes the LM head at the last position
only and prefills long rows without a padded attention mask, its KV cache is a budget that a request
too long for it fails against alone, and `make-model --context` / `builtin:qwen-vocab-tiny-32k` set
the context that the engines and the proxy's limits read."""
from __future__ import annotations

import json
import threading
import time
from pathlib import Path

import pytest
import torch

import stages.agentflow.engine as engine_mod
from pipeline.config import ConfigError, load_config
from stages.agentflow.engine import HFEngine
from stages.agentflow.limits import ContextLengthExceeded, PromptLimit, model_limits, raise_if_failed
from stages.agentflow.sampling import inverse_cdf, seeded_uniform


def _ids(eng, text: str) -> list[int]:
    return eng.tok(text, add_special_tokens=False)["input_ids"]


def _mixed(eng) -> list[dict]:
    """Contexts of different lengths (so a batch is padded), a group of one prompt, two temperatures."""
    rows = [{"prompt_ids": _ids(eng, p), "max_new_tokens": 6, "temperature": 1.0, "seed": s}
            for s, p in enumerate(["12+7=", "3+45=", "99+9=", "1+1=", "57+68="])]
    rows += [{"prompt_ids": _ids(eng, "44+4="), "max_new_tokens": 8, "temperature": 0.7, "seed": 10 + s}
             for s in range(3)]
    return rows


@torch.no_grad()
def _full_logits_reference(model, req: dict, eos: int) -> tuple[list[int], list[float]]:
    """The old computation, written out: each step a forward over the whole sequence without a cache,
    the LM head at every position ([T, V] logits), the last row sampled by the seeded inverse CDF."""
    seq, toks, lps, temp = list(req["prompt_ids"]), [], [], req["temperature"]
    for step in range(req["max_new_tokens"]):
        logits = model(input_ids=torch.tensor([seq])).logits      # [1, T, V]
        assert logits.shape[1] == len(seq)
        logp = torch.log_softmax(logits[0, -1].float() / temp, -1)
        u = torch.from_numpy(seeded_uniform([req["seed"]], [step]))
        tok = int(inverse_cdf(logp.exp()[None], u)[0])
        toks.append(tok)
        lps.append(float(logp[tok]))
        seq.append(tok)
        if tok == eos:
            break
    return toks, lps


@pytest.fixture(scope="module")
def reference(tiny_model_dir):
    eng = HFEngine(tiny_model_dir, seed=3)
    return eng, [_full_logits_reference(eng.model, r, eng.eos_id) for r in _mixed(eng)]


def _assert_same(out: list[dict], ref: list[tuple[list[int], list[float]]]) -> None:
    for o, (toks, lps) in zip(out, ref):
        assert o["response_ids"] == toks
        assert torch.allclose(torch.tensor(o["logprobs"]), torch.tensor(lps), atol=1e-5)


def test_engine_samples_and_scores_what_full_logits_give(reference, monkeypatch):
    eng, ref = reference
    _assert_same(eng.generate(_mixed(eng)), ref)
    monkeypatch.setattr(engine_mod, "PREFILL_MASK_ELEMS", 1)      # every distinct context prefilled alone
    _assert_same(eng.generate(_mixed(eng)), ref)


def test_the_lm_head_sees_only_the_last_position(tiny_model_dir):
    eng = HFEngine(tiny_model_dir, seed=0)
    seen = []
    hook = eng.model.get_output_embeddings().register_forward_hook(lambda m, i, o: seen.append(tuple(i[0].shape)))
    try:
        prompt = _ids(eng, "12+7=12+7=12+7=12+7=12+7=12+7=")
        eng.generate([{"prompt_ids": prompt, "max_new_tokens": 3, "seed": k} for k in range(2)])
    finally:
        hook.remove()
    assert seen and all(shape[1] == 1 for shape in seen), seen     # [rows, 1, hidden]: never [rows, T, hidden]


@pytest.fixture(scope="module")
def token_bytes(tiny_model_dir) -> int:
    eng = HFEngine(tiny_model_dir)
    cfg = eng.model.config      # keys and values of every layer, fp32
    assert eng.kv_token_bytes == cfg.num_hidden_layers * 2 * cfg.num_key_value_heads * (
        cfg.hidden_size // cfg.num_attention_heads) * 4
    return eng.kv_token_bytes


def test_a_request_over_the_kv_cache_fails_alone_and_names_the_key(tiny_model_dir, token_bytes):
    eng = HFEngine(tiny_model_dir, seed=1, kv_cache_mb=24 * token_bytes / 2 ** 20)
    assert eng.kv_cache_tokens == 24
    long = {"prompt_ids": _ids(eng, "12+7=" * 4), "max_new_tokens": 6, "seed": 0}     # 20 + 6 > 24
    short = {"prompt_ids": _ids(eng, "12+7="), "max_new_tokens": 6, "seed": 0}
    out = eng.generate([long, short])
    assert out[0]["status"] == "failed" and out[0]["code"] == "context_length_exceeded"
    assert "needs 26 tokens of KV cache (20 of context + up to 6 new)" in out[0]["error"]
    assert "engine's 24" in out[0]["error"] and "raise engine.kv_cache_mb" in out[0]["error"]
    assert out[1]["status"] in ("completed", "truncated") and out[1]["response_ids"]
    with pytest.raises(ContextLengthExceeded, match="engine.kv_cache_mb"):     # what a white-box agent sees
        raise_if_failed(out[0])


def test_rows_run_together_only_while_their_kv_cache_fits(tiny_model_dir, token_bytes):
    """Room for two rows of 11 tokens: five rows run two at a time, and sample what they sample unbounded."""
    eng = HFEngine(tiny_model_dir, seed=1, kv_cache_mb=22 * token_bytes / 2 ** 20)
    rows = [{"prompt_ids": _ids(eng, p), "max_new_tokens": 6, "seed": 7} for p in ["12+7=", "3+45=", "99+9=",
                                                                                  "5+51=", "8+80="]]
    eng.eos_id = -1                                     # every row decodes its whole budget
    bounded = eng.generate(rows)
    steps = eng.pop_stats()
    free = HFEngine(tiny_model_dir, seed=1)
    free.eos_id = -1
    assert [o["response_ids"] for o in bounded] == [o["response_ids"] for o in free.generate(rows)]
    assert steps["running_rows_max"] == 2


def test_kv_cache_setting_is_checked_by_key():
    assert load_config(None, []).engine.kv_cache_mb == engine_mod.KV_CACHE_MB
    with pytest.raises(ConfigError, match="engine.kv_cache_mb"):
        load_config(None, ["engine.kv_cache_mb=0"])


# ---- the context as a setting ----

@pytest.fixture(scope="module")
def qwen_tok():
    from stages.tasks.qwen_vocab import build_qwen_tokenizer

    return build_qwen_tokenizer()


def test_make_model_context_writes_it_and_the_limits_read_it(tmp_path, capsys):
    from pipeline.cli import main
    from stages.model import load_tokenizer

    out = tmp_path / "m"
    args = ["make-model", "--vocab", "qwen", str(out), "--hidden-size", "32", "--layers", "1"]
    assert main([*args, "--context", "20000"]) == 0
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["max_position_embeddings"] == 20000 and cfg["rope_parameters"]["rope_theta"] == 1_000_000
    assert json.loads((out / "tokenizer_config.json").read_text())["model_max_length"] == 20000
    assert model_limits(str(out)) == (20000, 151669)
    assert PromptLimit.for_model(str(out), load_tokenizer(str(out))).prompt_cap == 19999
    capsys.readouterr()
    assert main([*args[:3], str(tmp_path / "x"), "--context", "1"]) == 2
    assert "--context must be >= 2" in capsys.readouterr().err


def test_builtin_32k_model_has_32k_positions_and_32_dim_heads(tmp_path, qwen_tok):
    from stages.model import ModelConfig, resolve_model_path
    from stages.tasks.qwen_vocab import NAME_32K, qwen_tiny_32k_model_dir

    path = qwen_tiny_32k_model_dir(str(tmp_path), log=lambda *_: None, tokenizer=qwen_tok)
    logged = []
    assert resolve_model_path(ModelConfig(path=f"builtin:{NAME_32K}", cache_dir=str(tmp_path)),
                              log=logged.append) == path and not logged
    cfg = json.loads(Path(path, "config.json").read_text())
    assert cfg["max_position_embeddings"] == 32768 and cfg["vocab_size"] == 151669
    assert cfg["hidden_size"] // cfg["num_attention_heads"] >= 32      # vLLM's CPU attention needs it
    assert cfg["rope_parameters"]["rope_theta"] == 1_000_000
    eng = HFEngine(path)
    assert eng.context == 32768
    over = eng.generate([{"prompt_ids": [9707] * 32768, "max_new_tokens": 1}])[0]
    assert over["status"] == "failed" and "context of 32768" in over["error"]


def _peak_rss_during(fn) -> tuple[object, int]:
    import psutil

    proc, peak, done = psutil.Process(), [0], threading.Event()

    def watch():
        while not done.is_set():
            peak[0] = max(peak[0], proc.memory_info().rss)
            time.sleep(0.02)

    base = proc.memory_info().rss
    t = threading.Thread(target=watch, daemon=True)
    t.start()
    try:
        return fn(), peak[0] - base
    finally:
        done.set()
        t.join()


@pytest.mark.slow   # ~30-60 s of prefill on 2 cores
def test_a_32k_prompt_and_a_19k_one_prefill_in_bounded_memory(tmp_path, qwen_tok):
    """Without the last-position head the 32k prefill alone would make a 20 GB logits tensor, and the
    two rows of different lengths a 3.5 GB padded attention mask."""
    from stages.tasks.qwen_vocab import qwen_tiny_32k_model_dir

    eng = HFEngine(qwen_tiny_32k_model_dir(str(tmp_path), log=lambda *_: None, tokenizer=qwen_tok))
    g = torch.Generator().manual_seed(0)
    reqs = [{"prompt_ids": torch.randint(0, 151_000, (n,), generator=g).tolist(), "max_new_tokens": 2, "seed": 0}
            for n in (32_700, 18_825)]
    out, grew = _peak_rss_during(lambda: eng.generate(reqs))
    assert [o["status"] for o in out] == ["truncated", "truncated"]
    assert grew < 600 * 2 ** 20, grew / 2 ** 20
