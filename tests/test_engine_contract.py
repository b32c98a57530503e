"""One engine contract (stages/agentflow/engine_contract.py) for the HF, vLLM and SGLang engines.

Without vLLM or SGLang installed: every engine class answers each method of the contract with the
contract's arguments (the library engines import their library lazily), the pieces they share
behave (the hold/update gate with real threads, sampling settings, statistics, LoRA adapter slots), and the HF engine
passes the contract's checks (tests/support/engine_checks.py). vLLM passes them in the `vllm` tier and
SGLang in benchmarks/gpu/sglang_check.py.
"""
from __future__ import annotations

import inspect
import os
import threading
import time

import pytest

from stages.agentflow import engine_contract as contract
from stages.agentflow.engine import HFEngine
from stages.agentflow.sampling import Sampling, sampling_of
from stages.agentflow.sglang_engine import SGLangEngine
from stages.agentflow.vllm_engine import VLLMEngine
from tests.support.engine_checks import check_generation, check_refusals, check_resume

# the contract's methods (engine_contract.py's docstring) and their leading arguments
METHODS = {"generate": ["self", "requests"], "abort_all": ["self"], "mesh": ["self", "method", "args", "kwargs"],
           "load_weights": ["self", "named_tensors", "version"], "needs_sync": ["self"], "info": ["self"],
           "weight_version": ["self"], "weight_specs": ["self"], "pop_stats": ["self"]}


@pytest.mark.parametrize("cls", [HFEngine, VLLMEngine, SGLangEngine], ids=lambda c: c.__name__)
def test_every_engine_class_answers_the_contract(cls):
    for name, want in METHODS.items():
        # Ray's tracing adds `_ray_trace_ctx` to a class's methods once the class has been an actor class
        got = [p for p in inspect.signature(getattr(cls, name)).parameters if p != "_ray_trace_ctx"]
        assert got[:len(want)] == want, (cls.__name__, name, got)
    # the controller builds every engine with the same five leading arguments
    init = list(inspect.signature(cls.__init__).parameters)[1:6]
    assert init == ["model_path", "dtype", "seed", "num_threads", "engine_id"], (cls.__name__, init)


@pytest.fixture(scope="module")
def hf(tiny_model_dir):
    return HFEngine(tiny_model_dir, seed=0)


@pytest.fixture(scope="module")
def prompts(hf):
    return [hf.tok(p, add_special_tokens=False)["input_ids"] for p in ("12+7=", "3+45=", "99+9=", "40+2=")]


def test_the_hf_engine_keeps_the_contract(hf, prompts):
    check_generation(hf.generate, hf.eos_id, prompts)
    check_refusals(hf.generate, hf.eos_id, prompts, hf.context)
    check_resume(hf.generate, hf.eos_id, prompts)
    info = hf.info()
    assert info["engine"] == "hf" and info["version"] == 0 and info["incarnation"] == hf.incarnation
    st = hf.pop_stats()
    assert set(st) == {"requests", "tokens", "busy_s", "decode_steps", "running_rows_mean", "running_rows_max",
                       "queue_wait_s_mean", "queue_wait_s_max"}
    assert st["requests"] > 0 and st["tokens"] > 0


def test_a_hold_call_keeps_updates_out_and_waits_for_one_in_progress():
    gate, log = contract.VersionGate(), []

    def update(tag):
        with gate.updating():
            log.append(f"{tag} start")
            time.sleep(0.05)
            log.append(f"{tag} end")

    with gate.holding():
        t = threading.Thread(target=update, args=("u1",))
        t.start()
        time.sleep(0.05)
        assert log == []                # the update waits for the hold call
    t.join(5)
    assert log == ["u1 start", "u1 end"]

    log.clear()
    second = threading.Event()
    with gate.updating():               # two updates queued: a hold call waits for both
        t2 = threading.Thread(target=lambda: (second.set(), update("u2")))
        t2.start()
        second.wait(5)
        def hold():
            with gate.holding():
                log.append("hold")

        held = threading.Thread(target=hold)
        held.start()
        time.sleep(0.05)
        assert "hold" not in log
    t2.join(5)
    held.join(5)
    assert log.index("hold") > log.index("u2 end"), log
    with gate.holding(False):           # an ordinary call does not take the gate
        with gate.updating():
            pass


def test_sampling_settings_as_a_library_engine_takes_them():
    s = sampling_of({"temperature": 0.7, "top_p": 0.9, "seed": 41, "prefix_ids": [5, 6]})
    assert (s.temperature, s.top_p, s.seed) == (0.7, 0.9, 43)
    assert sampling_of({"temperature": 0.0, "top_p": 0.5}) == Sampling(0.0, 1.0, None)
    assert sampling_of({"seed": 2 ** 63 - 1, "prefix_ids": [1]}).seed == 0


def test_an_adapter_is_freed_once_neither_newest_nor_bound():
    slots = contract.AdapterSlots("engine7")
    try:
        assert slots.bind() is None and slots.unbind(None) == []       # no adapter yet: the base
        assert slots.advance(1) == []
        first = slots.bind()
        assert first == 1 and slots.advance(2) == []                    # v1 still serves a request
        assert slots.unbind(first) == [1]                               # its last request returned
        assert slots.bind() == 2 and slots.advance(3) == []
        assert slots.unbind(2) == [2] and slots.current == 3
        assert slots.path(3).startswith(slots.dir)
    finally:
        slots.remove()
    assert not os.path.exists(slots.dir)


def test_a_restarted_engine_waits_for_weights_then_says_it_restarts(monkeypatch):
    from stages.agentflow.client import ENGINE_LOST, EngineRestarting

    monkeypatch.setattr(contract, "RESTART_WAIT_S", 0.05)
    synced = threading.Event()
    with pytest.raises(EngineRestarting, match="engine3 restarted and was not re-sent the current weights") as e:
        contract.wait_synced(synced, "engine3")
    assert isinstance(e.value, ENGINE_LOST)        # a proxy caller gets 503 (529), a trajectory is re-run
    synced.set()
    contract.wait_synced(synced, "engine3")
    assert contract.reconstructed() is False        # not in an actor
