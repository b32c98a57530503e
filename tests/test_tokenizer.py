"""load_tokenizer: the tokenizer a worker loads by class name is AutoTokenizer's, without torch;
the Python copies a tokenizer was built from are let go, and saving still writes it whole."""
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from stages.tokenizer import load_tokenizer, tokenizer_class_of

ROOT = Path(__file__).resolve().parent.parent
TEXTS = ["12+34=", "Hello  world\n<|im_start|> ünïcode 99", " leading space", ""]


@pytest.fixture(scope="module")
def qwen_dir(tmp_path_factory) -> str:
    from stages.tasks.qwen_vocab import build_qwen_tokenizer, qwen_tiny_model_dir

    return qwen_tiny_model_dir(str(tmp_path_factory.mktemp("qwen")), log=lambda *_: None,
                               tokenizer=build_qwen_tokenizer())


def _same(a, b) -> None:
    assert type(a) is type(b)
    for text in TEXTS:
        ids = a(text, add_special_tokens=False)["input_ids"]
        assert ids == b(text, add_special_tokens=False)["input_ids"]
        assert a.decode(ids, skip_special_tokens=True) == b.decode(ids, skip_special_tokens=True)
    assert a.get_vocab() == b.get_vocab()
    assert (a.eos_token_id, a.pad_token_id, a.chat_template) == (b.eos_token_id, b.pad_token_id, b.chat_template)
    assert a.special_tokens_map == b.special_tokens_map


@pytest.mark.parametrize("which", ["tiny", "qwen"])
def test_loading_by_class_name_gives_autotokenizers_tokenizer(which, raw_model_dir, request, tmp_path):
    path = raw_model_dir if which == "tiny" else request.getfixturevalue("qwen_dir")
    auto = load_tokenizer(path)
    by_name = load_tokenizer(path, tokenizer_class_of(auto))
    _same(auto, by_name)
    for name in ("_vocab", "_merges"):     # the build copies are gone; the Rust tokenizer serves
        assert getattr(auto, name, None) is None
    auto.save_pretrained(tmp_path)         # what a checkpoint writes: reloads to the same tokenizer
    _same(auto, load_tokenizer(str(tmp_path)))

    # a fresh process (a rollout or reward worker) loads it by name without importing torch
    code = ("import json, sys; from stages.tokenizer import load_tokenizer; "
            f"t = load_tokenizer({path!r}, {tokenizer_class_of(auto)!r}); "
            f"print(json.dumps([t({TEXTS[1]!r}, add_special_tokens=False)['input_ids'], 'torch' in sys.modules]))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT,
                         env={**os.environ, "PYTHONPATH": str(ROOT)}, check=True)
    ids, torch_loaded = json.loads(out.stdout.strip().splitlines()[-1])
    assert ids == auto(TEXTS[1], add_special_tokens=False)["input_ids"]
    assert not torch_loaded


def test_a_bad_class_name_says_which_directory(raw_model_dir):
    with pytest.raises(ValueError, match=f"model directory {raw_model_dir}: cannot load its tokenizer"):
        load_tokenizer(raw_model_dir, "transformers:NoSuchTokenizer")


def test_rollout_and_reward_workers_load_without_torch(raw_model_dir):
    """What a rollout or reward worker builds, given the tokenizer's class, imports no torch (~170 MB
    a process): not through the tokenizer, nor through the model's limits (model_limits)."""
    from stages.agentflow.limits import model_limits

    cls = tokenizer_class_of(load_tokenizer(raw_model_dir))
    code = ("import sys; from stages.agentflow.rollout import AgentFlowRollout; "
            "from stages.reward import Reward, RewardConfig; "
            f"r = AgentFlowRollout([None], None, {raw_model_dir!r}, {cls!r}); "
            f"w = Reward(RewardConfig(), {raw_model_dir!r}, 0, {cls!r}); "
            "print(r.limit.context, 'torch' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT,
                         env={**os.environ, "PYTHONPATH": str(ROOT)}, check=True)
    context, torch_loaded = out.stdout.split()[-2:]
    from transformers import AutoConfig

    assert int(context) == AutoConfig.from_pretrained(raw_model_dir).max_position_embeddings
    assert model_limits(raw_model_dir) == (int(context), AutoConfig.from_pretrained(raw_model_dir).vocab_size)
    assert torch_loaded == "False"
