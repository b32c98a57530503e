"""TeacherManager and the teacher scoring stage, on tiny real teachers saved to disk."""
import json
import os
import subprocess
import sys
from pathlib import Path

import pyarrow as pa
import pytest
import torch

from stages.model import load_model
from stages.schema import table_from_columns
from stages.tasks.make_teacher import SHARED_VOCAB, shared_tokenizer, tiny_qwen2
from stages.tasks.models import build_char_tokenizer
from stages.teacher import TeacherConfig, TeacherError, TeacherManager, TeacherScoring, check_teachers, teacher_metrics

ROOT = Path(__file__).resolve().parent.parent


def save_tiny(path: Path, seed: int, tok=None, hidden: int = 32, layers: int = 2) -> str:
    tok = tok or shared_tokenizer()
    model = tiny_qwen2(tok, hidden, layers, seed)
    model.save_pretrained(path)
    tok.save_pretrained(path)
    return str(path)


@pytest.fixture(scope="module")
def dirs(tmp_path_factory):
    """A student and three teachers (different seeds), all on the shared vocabulary."""
    root = tmp_path_factory.mktemp("teachers")
    return {name: save_tiny(root / name, seed) for seed, name in enumerate(("student", "add", "mul", "rev"))}


def cfg_for(dirs, **kw) -> TeacherConfig:
    base = dict(teachers={t: dirs[t] for t in ("add", "mul", "rev")},
                routes={"addition": "add", "multiplication": "mul", "reverse": "rev"})
    return TeacherConfig(**(base | kw))


def ids(text: str) -> list[int]:
    return shared_tokenizer()(text, add_special_tokens=False)["input_ids"]


def batch(rows: list[tuple]) -> pa.Table:
    """rows: (data_source, prompt, response, status)."""
    tok = shared_tokenizer()
    return table_from_columns({
        "data_source": [r[0] for r in rows], "prompt_ids": [ids(r[1]) for r in rows],
        "response_ids": [ids(r[2]) + ([tok.eos_token_id] if r[2] else []) for r in rows],
        "status": [r[3] for r in rows], "error": [""] * len(rows)})


def direct_logprobs(path: str, prompt_ids: list[int], response_ids: list[int], temperature: float = 1.0):
    """The reference: a plain HF forward of one unpadded sequence."""
    model = load_model(path)
    seq = torch.tensor([prompt_ids + response_ids])
    with torch.no_grad():
        logp = torch.log_softmax(model(input_ids=seq).logits[0].float() / temperature, -1)
    p = len(prompt_ids)
    return logp[p - 1: p - 1 + len(response_ids)]   # [T, V]


# ---- routing ------------------------------------------------------------------------------

def test_routing_by_data_source_and_default(dirs):
    c = cfg_for(dirs)
    assert [c.route(s) for s in ("addition", "multiplication", "reverse")] == ["add", "mul", "rev"]
    with pytest.raises(TeacherError, match="data_source 'poetry' has no teacher"):
        c.route("poetry")
    assert cfg_for(dirs, default="rev").route("poetry") == "rev"
    stage = TeacherScoring(cfg_for(dirs, routes={"addition": "add"}, default="mul"), dirs["student"])
    out = stage(batch([("addition", "1+2=", "3", "completed"), ("reverse", "12<=", "21", "completed")]))
    assert out.column("teacher_id").to_pylist() == ["add", "mul"]


# ---- residency ----------------------------------------------------------------------------

def _live_weight_bytes(mgr: TeacherManager) -> int:
    """Bytes actually held by every teacher's parameters (placeholders hold none)."""
    return sum(p.numel() * p.element_size() for t in mgr.teachers.values() for p in t.params.values())


@pytest.mark.parametrize("by", ["count", "bytes"])
def test_lru_swaps_stay_within_budget(dirs, by):
    probe = check_teachers(cfg_for(dirs), dirs["student"])
    size = probe["add"].nbytes
    assert all(s.nbytes == size for s in probe.values())   # same shapes: bytes and count budgets agree
    c = cfg_for(dirs, max_resident=2) if by == "count" else cfg_for(dirs, max_resident_bytes=2 * size + size // 2)
    m = TeacherManager(c, dirs["student"])
    assert _live_weight_bytes(m) == 0 and m.resident_bytes == 0     # nothing resident until asked
    for tid in ["add", "mul", "add", "rev", "mul", "mul", "add"]:
        m.acquire(tid)
        assert len(m.resident) <= 2 and m.resident_bytes <= 2 * size
        assert _live_weight_bytes(m) == m.resident_bytes            # accounting = what is really held
    # add, mul in; add hit; rev evicts mul (LRU); mul evicts add; mul hit; add evicts rev
    assert m.stats.history == ["+add", "+mul", "-mul", "+rev", "-add", "+mul", "-rev", "+add"]
    assert (m.stats.swaps_in, m.stats.swaps_out, m.stats.hits) == (5, 3, 2)
    assert m.stats.bytes_in == 5 * size and m.stats.peak_resident_bytes == 2 * size
    assert list(m.resident) == ["mul", "add"]
    assert m.order(["rev", "add", "mul"]) == ["mul", "add", "rev"]  # resident first: one swap, not three


RSS_SCRIPT = r"""
import json, sys
from stages.teacher import TeacherConfig, TeacherManager
def rss():
    return int(open("/proc/self/statm").read().split()[1]) * 4096
dirs = json.loads(sys.argv[1])
budget = int(sys.argv[2])
m = TeacherManager(TeacherConfig(teachers=dirs, max_resident=budget), dirs["t0"])
base, peak = rss(), 0
for tid in ["t0", "t1", "t2", "t0", "t1", "t2"]:
    m.acquire(tid)
    peak = max(peak, rss())
print(json.dumps({"grew": peak - base, "teacher": m.specs["t0"].nbytes, "swaps": m.stats.swaps_in}))
"""


@pytest.mark.e2e
def test_process_rss_stays_within_budget(tmp_path):
    """Measured by the OS, not by the manager: budget 1 of 3 teachers grows RSS by about one
    teacher, all resident by about three. A fixed mmap threshold makes glibc return freed
    weights to the OS at once (its adaptive threshold would keep them in the heap)."""
    tok = shared_tokenizer()
    dirs = {f"t{i}": save_tiny(tmp_path / f"t{i}", i, tok, hidden=256, layers=3) for i in range(3)}
    env = os.environ | {"MALLOC_MMAP_THRESHOLD_": "131072", "OMP_NUM_THREADS": "1",
                        "PYTHONPATH": str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", "")}
    res = {}
    for budget in (1, 3):
        out = subprocess.run([sys.executable, "-c", RSS_SCRIPT, json.dumps(dirs), str(budget)], env=env,
                             capture_output=True, text=True, timeout=300)
        assert out.returncode == 0, out.stderr[-2000:]
        res[budget] = json.loads(out.stdout.strip().splitlines()[-1])
    one = res[1]["teacher"]
    assert one > 8e6                                         # big enough to see over allocator noise
    assert res[1]["swaps"] == 6 and res[3]["swaps"] == 3
    assert res[1]["grew"] < 1.5 * one, res
    assert res[3]["grew"] > 2.5 * one, res


# ---- scoring --------------------------------------------------------------------------------

ROWS = [("addition", "12+7=", "19", "completed"), ("multiplication", "23*4=", "92", "completed"),
        ("addition", "5+5=", "10", "truncated"), ("multiplication", "9*9=", "881", "completed")]


def test_teacher_logprobs_equal_direct_hf_forward(dirs):
    stage = TeacherScoring(cfg_for(dirs, top_k=3, temperature=0.7), dirs["student"])
    t = batch(ROWS)
    out = stage(t)
    assert out.column("status").to_pylist() == [r[3] for r in ROWS]
    assert out.column("teacher_id").to_pylist() == ["add", "mul", "add", "mul"]
    for row in out.to_pylist():
        ref = direct_logprobs(dirs[row["teacher_id"]], row["prompt_ids"], row["response_ids"], temperature=0.7)
        want = ref.gather(-1, torch.tensor(row["response_ids"])[:, None])[:, 0]
        assert len(row["teacher_logprobs"]) == len(row["response_ids"])
        torch.testing.assert_close(torch.tensor(row["teacher_logprobs"]), want, atol=2e-5, rtol=0)
        top = ref.topk(3, -1)
        assert row["teacher_topk_ids"] == top.indices.tolist()
        torch.testing.assert_close(torch.tensor(row["teacher_topk_logprobs"]), top.values, atol=2e-5, rtol=0)


def test_swapped_out_and_back_is_bit_identical(dirs):
    stage = TeacherScoring(cfg_for(dirs, max_resident=1), dirs["student"])
    t = batch(ROWS)
    first = stage(t).column("teacher_logprobs").to_pylist()
    stage.manager.acquire("rev")                       # budget 1: both add and mul are out now
    assert list(stage.manager.resident) == ["rev"]
    again = stage(t)
    assert again.column("teacher_logprobs").to_pylist() == first   # exact float equality
    assert sum(again.column("teacher_swaps").to_pylist()) == 2        # add and mul came back once each


def test_stage_marks_bad_rows_failed_and_scores_the_rest(dirs):
    stage = TeacherScoring(cfg_for(dirs, routes={"addition": "add", "multiplication": "mul"},
                                   max_resident=1, micro_batch=8), dirs["student"])
    t = batch(ROWS + [("poetry", "1+1=", "2", "completed"), ("addition", "1+1=", "2", "failed"),
                      ("addition", "3+3=", "", "truncated")])
    oov = t.column("response_ids").to_pylist()
    oov[0] = oov[0] + [10_000]                        # not a token id any teacher has: its forward fails
    t = t.set_column(t.schema.get_field_index("response_ids"), "response_ids",
                     pa.array(oov, t.schema.field("response_ids").type))
    out = stage(t).to_pylist()
    status = [r["status"] for r in out]
    assert status == ["failed", "completed", "truncated", "completed", "failed", "failed", "truncated"]
    assert "teacher stage: teacher 'add' failed on this row: IndexError" in out[0]["error"]
    assert "data_source 'poetry' has no teacher" in out[4]["error"]
    assert out[5]["error"] == "" and out[5]["teacher_id"] is None     # failed upstream: left alone
    assert out[2]["teacher_logprobs"] and out[1]["teacher_logprobs"] and out[3]["teacher_logprobs"]
    assert out[6]["teacher_logprobs"] == [] and out[0]["teacher_logprobs"] is None
    table = stage(t)
    m = teacher_metrics(table)
    assert m["teacher/failed"] == 2 and m["teacher/scored"] == 4
    assert m["teacher/swaps"] == 1                    # budget 1, mul resident from the first call: add swaps in
    assert m["teacher/swap_bytes"] == stage.manager.specs["add"].nbytes


# ---- bad input at start -----------------------------------------------------------------------

def test_bad_teacher_set_ups_fail_at_start_naming_the_teacher(dirs, tmp_path):
    with pytest.raises(TeacherError, match="teacher 'ghost': directory .* does not exist"):
        check_teachers(cfg_for(dirs, teachers={"ghost": str(tmp_path / "nope")}, routes={}), dirs["student"])
    narrow = save_tiny(tmp_path / "narrow", 5, tok=build_char_tokenizer("0123456789+="))
    with pytest.raises(TeacherError, match="teacher 'narrow' .* tokenizer does not match the student's"):
        check_teachers(TeacherConfig(teachers={"narrow": narrow}), dirs["student"])
    with pytest.raises(TeacherError, match="data_source 'reverse' has no teacher"):
        check_teachers(cfg_for(dirs, routes={"addition": "add"}), dirs["student"], sources={"addition", "reverse"})
    size = check_teachers(cfg_for(dirs), dirs["student"])["add"].nbytes
    with pytest.raises(TeacherError, match=f"max_resident_bytes={size - 1} is smaller than teacher 'add'"):
        check_teachers(cfg_for(dirs, max_resident_bytes=size - 1), dirs["student"])
    bare = tmp_path / "bare"
    save_tiny(bare, 6)
    (bare / "model.safetensors").unlink()
    with pytest.raises(TeacherError, match="teacher 'bare' .* no model.safetensors"):
        check_teachers(TeacherConfig(teachers={"bare": str(bare)}), dirs["student"])
    with pytest.raises(TeacherError, match="teacher.routes.addition names teacher 'x'"):
        TeacherConfig(teachers={"add": dirs["add"]}, routes={"addition": "x"})
    with pytest.raises(TeacherError, match="teacher.default 'x' is not in teacher.teachers"):
        TeacherConfig(teachers={"add": dirs["add"]}, default="x")
    assert len(SHARED_VOCAB) == len(set(SHARED_VOCAB)) and set("0123456789+*<=") <= set(SHARED_VOCAB)


def test_stage_runs_as_a_ray_data_actor_pool(dirs, ray_session):
    from ray.data import ActorPoolStrategy

    ds = ray_session.data.from_arrow(batch(ROWS)).map_batches(
        TeacherScoring, fn_constructor_args=(cfg_for(dirs), dirs["student"]), batch_format="pyarrow",
        compute=ActorPoolStrategy(size=1), num_cpus=0.1)
    out = pa.concat_tables(list(ds.iter_batches(batch_size=None, batch_format="pyarrow")))
    assert sorted(out.column("teacher_id").to_pylist()) == ["add", "add", "mul", "mul"]
    assert all(len(lp) == len(r) for lp, r in zip(out.column("teacher_logprobs").to_pylist(),
                                                 out.column("response_ids").to_pylist()))


# ---- make-teacher -----------------------------------------------------------------------------

def test_make_teacher_and_prompts_give_a_recipe_that_passes_the_start_checks(tmp_path):
    import argparse

    from stages.tasks.make_teacher import add_subcommand, make_teacher

    card = make_teacher("multiplication", tmp_path / "mul", steps=3, hidden_size=32, num_layers=1, eval_n=5,
                        log=lambda *_: None)
    assert json.loads((tmp_path / "mul" / "teacher_card.json").read_text()) == card
    assert card["vocab"] == SHARED_VOCAB and 0.0 <= card["accuracy/multiplication/greedy"] <= 1.0
    make_teacher("addition,multiplication", tmp_path / "student", steps=0, hidden_size=32, num_layers=1, eval_n=5,
                 log=lambda *_: None)
    parser = argparse.ArgumentParser()
    add_subcommand(parser.add_subparsers(dest="cmd"))
    args = parser.parse_args(["make-teacher", "--task", "addition,multiplication", "--prompts", str(tmp_path / "d")])
    assert args.fn(args) == 0
    train = [json.loads(line) for line in (tmp_path / "d" / "train.jsonl").read_text().splitlines()]
    assert [r["data_source"] for r in train[:4]] == ["addition", "multiplication"] * 2
    specs = check_teachers(TeacherConfig(teachers={"mul": str(tmp_path / "mul")}, default="mul"),
                           str(tmp_path / "student"), sources={r["data_source"] for r in train})
    assert specs["mul"].nbytes > 0
    with pytest.raises(ValueError, match="unknown built-in task 'poetry'"):
        make_teacher("poetry", tmp_path / "x", steps=1)
