"""A run's memory: the tokenizer is loaded by the processes that need it, a large one by one process at a
time, and the driver loads it once."""
import json
import time
from pathlib import Path

import pytest


@pytest.fixture(scope="module")
def qwen_dir(tmp_path_factory) -> str:
    """A Qwen-vocabulary model (18.6 MB tokenizer.json: a large tokenizer), hidden 32, 1 layer."""
    from stages.tasks.qwen_vocab import qwen_tiny_model_dir

    return qwen_tiny_model_dir(str(tmp_path_factory.mktemp("qwen")), log=lambda *_: None, hidden_size=32,
                               num_layers=1)


def test_an_engine_given_the_special_ids_loads_no_tokenizer_and_generates_the_same(raw_model_dir):
    from stages.agentflow.engine import HFEngine
    from stages.model import load_tokenizer

    tok = load_tokenizer(raw_model_dir)
    reqs = [{"prompt_ids": tok("12+7=", add_special_tokens=False)["input_ids"], "max_new_tokens": 6, "seed": s}
            for s in range(4)]
    own = HFEngine(raw_model_dir, seed=1)
    given = HFEngine(raw_model_dir, seed=1, special_ids=(tok.eos_token_id, tok.pad_token_id))
    assert not hasattr(given, "tok") and hasattr(own, "tok")
    assert (given.eos_id, given.pad_id) == (own.eos_id, own.pad_id)
    assert [r["response_ids"] for r in given.generate(reqs)] == [r["response_ids"] for r in own.generate(reqs)]


def _load_while_locked(lock_path: Path, model_dir: str, hold_s: float) -> float:
    """Hold the tokenizer-load lock for hold_s while a thread loads model_dir's tokenizer: the seconds
    from our release to its load's end (negative: it ended while we held the lock)."""
    import fcntl
    import threading

    from stages.tokenizer import load_tokenizer

    done = []
    with open(lock_path, "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)     # another open file description: it excludes this process too
        t = threading.Thread(target=lambda: done.append((load_tokenizer(model_dir), time.time())), daemon=True)
        t.start()
        t.join(hold_s)
        released = time.time()
    t.join(300)
    assert done, "the tokenizer did not load"
    return done[0][1] - released


def test_a_large_tokenizer_is_parsed_by_one_process_at_a_time(tmp_path, qwen_dir, raw_model_dir, monkeypatch):
    """This host's lock held: a large tokenizer's load waits for it (~1 s of parsing otherwise); a small
    one (the built-in tasks') does not."""
    import stages.tokenizer as tokenizer_mod

    monkeypatch.setattr(tokenizer_mod, "LOAD_LOCK", tmp_path / "load.lock")
    assert _load_while_locked(tmp_path / "load.lock", qwen_dir, 5) > 0
    assert _load_while_locked(tmp_path / "load.lock", raw_model_dir, 60) < 0


def test_the_driver_loads_the_tokenizer_once_and_keeps_it_only_for_evaluation(tmp_path, qwen_dir, monkeypatch):
    """No evaluation set: the driver keeps no tokenizer and makes no local reward stage; the engines get
    the special ids. With one: evaluation's reward stage shares the driver's tokenizer."""
    import stages.tokenizer as tokenizer_mod
    from pipeline.config import load_config
    from pipeline.controller import Controller

    loads = []      # every load_tokenizer ends in release_build_copies
    real = tokenizer_mod.release_build_copies
    monkeypatch.setattr(tokenizer_mod, "release_build_copies", lambda tok: loads.append(tok) or real(tok))
    data = tmp_path / "data.jsonl"
    data.write_text(json.dumps({"prompt": "the of and", "answer": "42"}) + "\n")
    base = [f"model.path={qwen_dir}", f"data.path={data}", "reward.fn=exact_match"]
    ctl = Controller(load_config(None, base), tmp_path / "run", log=lambda *_: None)
    assert ctl.tok is None and ctl.evaluator is None
    assert ctl.special_ids == (151645, 151643)        # <|im_end|>, <|endoftext|>
    ctl = Controller(load_config(None, [*base, f"data.test_path={data}", "eval.num_prompts=1"]), tmp_path / "run",
                     log=lambda *_: None)
    assert ctl.tok is not None and ctl.evaluator.reward.tok is ctl.tok
    assert len(loads) == 2          # once per driver: model.path's check and the reward stage load none


def test_a_checkpoint_copies_the_staged_tokenizer_instead_of_loading_it(tmp_path, qwen_dir, monkeypatch):
    """What stage_tokenizer wrote is what loading and saving writes, byte for byte; save_tokenizer copies
    it without a parse, and loads and saves where the staged copy is not there (another host)."""
    import stages.tokenizer as tokenizer_mod
    from stages.tokenizer import load_tokenizer, save_tokenizer, stage_tokenizer

    staged = stage_tokenizer(load_tokenizer(qwen_dir), tmp_path / "staged")
    loads = []
    real = tokenizer_mod.release_build_copies
    monkeypatch.setattr(tokenizer_mod, "release_build_copies", lambda tok: loads.append(tok) or real(tok))
    (tmp_path / "copied").mkdir()
    save_tokenizer(tmp_path / "copied", qwen_dir, staged)
    assert not loads
    (tmp_path / "saved").mkdir()
    save_tokenizer(tmp_path / "saved", qwen_dir, str(tmp_path / "elsewhere"))
    assert len(loads) == 1
    names = sorted(f.name for f in (tmp_path / "saved").iterdir())
    assert names == sorted(f.name for f in (tmp_path / "copied").iterdir()) and "tokenizer.json" in names
    for name in names:
        assert (tmp_path / "saved" / name).read_bytes() == (tmp_path / "copied" / name).read_bytes(), name
