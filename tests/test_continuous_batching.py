"""Continuous batching in the embedded engine: rows join and leave the running batch between
decode steps, sample what they sample alone, and let weights land and aborts bite per step."""
import json
import shutil
import threading
import time

import pytest
import torch

from pipeline.config import ConfigError, load_config
from stages.agentflow.engine import HFEngine


def _reqs(eng, prompts, **kw):
    return [{"prompt_ids": eng.tok(p, add_special_tokens=False)["input_ids"], "max_new_tokens": 6,
             "temperature": 1.0} | kw for p in prompts]


def _mixed(eng) -> list[dict]:
    """A rollout-like mix: contexts of different lengths, a group of one prompt, greedy and top-p rows,
    a resumed partial rollout, budgets from 1 to 24 tokens."""
    rows = _reqs(eng, ["12+7=", "3+45=", "99+9=", "1+1=", "57+68=", "8+80="], seed=3)
    rows += [r | {"seed": s, "max_new_tokens": 24} for s, r in enumerate(_reqs(eng, ["44+4="] * 4))]
    rows += _reqs(eng, ["6+6=", "70+1="], temperature=0.0, max_new_tokens=3)
    rows += _reqs(eng, ["23+9=", "5+51="], top_p=0.8, seed=8, max_new_tokens=1)
    rows.append(_reqs(eng, ["12+7="], seed=3)[0] | {"prefix_ids": eng.tok("1", add_special_tokens=False)["input_ids"],
                                                    "prefix_logprobs": [-0.5], "prefix_versions": [0]})
    return rows


def test_a_batch_samples_what_each_row_samples_alone(tiny_model_dir):
    cont = HFEngine(tiny_model_dir, seed=5)
    reqs = _mixed(cont)
    a = [cont.generate([r])[0] for r in reqs]       # one row at a time: nothing to batch with
    b = cont.generate(reqs)
    for x, y in zip(a, b):
        assert x["response_ids"] == y["response_ids"] and x["status"] == y["status"]
        assert x["versions"] == y["versions"]
        # the same tokens; log-probs agree to float rounding (a row's cache is padded to other widths,
        # so the attention sums run over other lengths of zero-weight columns)
        assert torch.allclose(torch.tensor(x["logprobs"]), torch.tensor(y["logprobs"]), atol=1e-5)
    # the same rows sent one call each, at staggered times: they join a running batch and still
    # sample what they sample alone
    got: dict[int, dict] = {}

    def call(i):
        got[i] = cont.generate([reqs[i]])[0]

    threads = [threading.Thread(target=call, args=(i,)) for i in range(len(reqs))]
    for t in threads:
        t.start()
        time.sleep(0.002)
    for t in threads:
        t.join()
    assert [got[i]["response_ids"] for i in range(len(reqs))] == [x["response_ids"] for x in a]
    st = cont.pop_stats()
    assert st["requests"] == 3 * len(reqs) and st["decode_steps"] > 0
    assert 1 <= st["running_rows_mean"] <= st["running_rows_max"] <= len(reqs)


@pytest.fixture(scope="module")
def long_model_dir(tiny_model_dir, tmp_path_factory) -> str:
    """The tiny model with room for long generations: its positions are rotary (nothing learned per
    position), so a longer context is a config change."""
    out = tmp_path_factory.mktemp("long") / "model"
    shutil.copytree(tiny_model_dir, out)
    cfg = json.loads((out / "config.json").read_text())
    (out / "config.json").write_text(json.dumps(cfg | {"max_position_embeddings": 2048}))
    return str(out)


def _endless(eng, budget: int, **kw) -> dict:
    """A row that samples its whole budget: this engine's EOS id is moved out of the vocabulary."""
    eng.eos_id = -1
    return _reqs(eng, ["12+7="], max_new_tokens=budget, seed=1, **kw)[0]


def test_a_short_turn_joins_a_long_generation_and_leaves_before_it(long_model_dir):
    eng = HFEngine(long_model_dir, seed=1)
    long_row, short_row = _endless(eng, 400), _endless(eng, 3)
    done: dict[str, float] = {}

    def call(name, row):
        eng.generate([row])
        done[name] = time.perf_counter()

    t_long = threading.Thread(target=call, args=("long", long_row))
    t_long.start()
    time.sleep(0.2)         # the long row is decoding
    t0 = time.perf_counter()
    call("short", short_row)
    short_s = done["short"] - t0
    t_long.join()
    assert done["short"] < done["long"]             # it did not wait for the long generation
    st = eng.pop_stats()
    assert st["running_rows_max"] == 2              # both rows decoded in one batch
    assert short_s < 0.5 * (done["long"] - t0), short_s
    assert st["queue_wait_s_max"] < 0.5


def test_weights_land_and_aborts_bite_between_decode_steps(long_model_dir):
    eng = HFEngine(long_model_dir, seed=1)
    row = _endless(eng, 300)
    out: dict = {}
    t = threading.Thread(target=lambda: out.update(eng.generate([row])[0]))
    t.start()
    time.sleep(0.2)
    eng.load_weights({}, version=7)                 # a version lands mid-row (partial rollout)
    time.sleep(0.1)
    t_abort = time.perf_counter()
    eng.abort_all()
    t.join()
    waited = time.perf_counter() - t_abort
    assert out["status"] == "aborted" and len(out["response_ids"]) < 300
    assert out["versions"][0] == 0 and out["versions"][-1] == 7
    assert out["versions"] == sorted(out["versions"])
    assert waited < 0.5, waited                     # within a decode step or so, not at the row's end
    # a held call keeps one version for the whole call: a version sent meanwhile lands after it
    held: dict = {}
    t = threading.Thread(target=lambda: held.update(eng.generate([_endless(eng, 200, hold=True)])[0]))
    t.start()
    time.sleep(0.2)
    eng.load_weights({}, version=8)
    t.join()
    assert held["status"] == "truncated" and set(held["versions"]) == {7} and eng.weight_version() == 8


def test_a_full_running_batch_queues_rows_first_come_first_served(long_model_dir):
    eng = HFEngine(long_model_dir, seed=1, max_running_rows=1)
    rows = [_endless(eng, 40) | {"seed": s} for s in range(3)]
    out = eng.generate(rows)
    assert [o["status"] for o in out] == ["truncated"] * 3
    st = eng.pop_stats()
    assert st["running_rows_max"] == 1 and st["decode_steps"] == 3 * 40
    assert st["queue_wait_s_max"] > 0.0             # the third row waited for two others
    alone = HFEngine(long_model_dir, seed=1)
    alone.eos_id = -1
    assert [o["response_ids"] for o in out] == [o["response_ids"] for o in alone.generate(rows)]


def test_batching_settings_are_checked_by_key():
    with pytest.raises(ConfigError, match="rollout.engine_batching"):      # one decode loop: no such key
        load_config(None, ["rollout.engine_batching=static"])
    with pytest.raises(ConfigError, match="engine.max_rows"):
        load_config(None, ["engine.max_rows=0"])
