"""What transfer/compat/ relies on in each foreign library, checked on the installed release: the internals it
reads or replaces are there and behave as its functions assume. pyproject.toml pins the releases
they were read against; an upgrade that changes one fails here, not in a run. Real objects, no
mocks. vLLM's checks run in the vLLM tier (`-m vllm`, its own venv); SGLang's where it is installed
(it reads SGLang's source, so no GPU is needed)."""
from __future__ import annotations

import ast
import importlib.metadata
import importlib.util
import inspect
import threading
from datetime import timedelta
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


def test_the_installed_releases_are_the_pinned_ones():
    tomllib = pytest.importorskip("tomllib")
    from packaging.requirements import Requirement

    deps = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["dependencies"]
    pins = {r.name: r for r in map(Requirement, deps)}
    for name in ("torch", "ray", "transformers"):
        installed = importlib.metadata.version(name)
        assert pins[name].specifier.contains(installed, prereleases=True), (name, installed, str(pins[name]))


# ---- torch -------------------------------------------------------------------------------------
def test_torch_native_thread_setter_sets_the_thread_count():
    import torch

    from transfer.compat.torch_api import set_native_threads

    before = torch.get_num_threads()
    try:
        for n in (1, 2):
            set_native_threads(n)
            assert torch.get_num_threads() == n
    finally:
        torch.set_num_threads(before)


def test_torch_gloo_group_bound_to_an_address_broadcasts():
    import torch
    import torch.distributed as dist

    from transfer.compat.torch_api import gloo_group

    td = timedelta(seconds=30)
    master = dist.TCPStore("127.0.0.1", 0, None, True, td, wait_for_workers=False)
    out = {}

    def rank(r: int) -> None:
        store = master if r == 0 else dist.TCPStore("127.0.0.1", master.port, None, False, td)
        pg = gloo_group(dist.PrefixStore("compat", store), r, 2, "127.0.0.1", td)
        t = torch.arange(4.0) if r == 0 else torch.zeros(4)
        pg.broadcast(t, 0).wait(td)
        out[r] = (type(pg), t.tolist())

    threads = [threading.Thread(target=rank, args=(r,)) for r in (0, 1)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert out == {r: (dist.ProcessGroupGloo, [0.0, 1.0, 2.0, 3.0]) for r in (0, 1)}


def test_torch_device_constructors_are_the_tensor_factories():
    import torch

    from transfer.compat.torch_api import device_constructors

    assert {torch.empty, torch.zeros, torch.ones, torch.full, torch.arange, torch.tensor} <= device_constructors()


# ---- Ray ---------------------------------------------------------------------------------------
def test_ray_data_executor_waits_through_the_globals_that_are_swapped():
    from ray.data._internal.execution import streaming_executor_state as state

    from transfer.compat.ray_api import executor_ray, executor_wait_internals, set_executor_wait

    assert executor_wait_internals() == []
    # process_completed_tasks looks both names up in its module at each call: a swap takes effect at once
    fn = state.process_completed_tasks
    assert fn.__globals__ is vars(state) and {"ray", "WAIT_FOR_TASK_COMPLETION_TIMEOUT_S"} <= set(fn.__code__.co_names)
    real, timeout = executor_ray(), state.WAIT_FOR_TASK_COMPLETION_TIMEOUT_S
    stand_in = type("StandIn", (), {"wait": staticmethod(lambda *a, **k: ([], []))})()
    try:
        set_executor_wait(stand_in, 0.5)
        assert state.ray is stand_in and state.WAIT_FOR_TASK_COMPLETION_TIMEOUT_S == 0.5
    finally:
        set_executor_wait(real, timeout)


def test_ray_pushed_errors_reach_the_callback_while_the_block_runs():
    from ray._private import worker

    from transfer.compat.ray_api import pushed_errors_to

    printer = worker.print_to_stdstream
    # Ray's error listener looks the printer up in its module at each call, and calls it with (data, ignore_prefix)
    assert "print_to_stdstream" in worker.listen_error_messages.__code__.co_names
    assert list(inspect.signature(printer).parameters)[:2] == ["data", "ignore_prefix"]
    seen = []
    with pushed_errors_to(lambda data, ignore_prefix=False: seen.append(data)):
        worker.print_to_stdstream({"lines": ["boom"], "pid": 7}, False)
    assert seen == [{"lines": ["boom"], "pid": 7}] and worker.print_to_stdstream is printer


# ---- transformers ------------------------------------------------------------------------------
def transformers_checks(model_dir: str, tmp_path: Path) -> None:
    """Everything transfer/compat/transformers_api.py relies on, on a tiny Qwen2 (also run by the vLLM tier,
    whose venv has the oldest transformers the pin admits)."""
    import tokenizers
    import torch
    from transformers import AutoTokenizer

    from stages.model import load_model
    from transfer.compat.transformers_api import (
        attn_implementation,
        cache_kv,
        drop_build_copies,
        forward_kwargs,
        set_cache_kv,
    )

    model = load_model(model_dir, "float32")
    cache_kw, last_only = forward_kwargs(model)
    assert last_only == {"logits_to_keep": 1}
    # the cache's layers hold each layer's K/V; rows gathered into it decode as the row alone does
    with torch.no_grad():
        o = model(input_ids=torch.tensor([[1, 2, 3], [4, 5, 6]]), use_cache=True, **last_only)
        assert o.logits.shape[1] == 1
        cache = o[cache_kw]
        kv = cache_kv(cache)
        cfg = model.config
        assert len(kv) == cfg.num_hidden_layers and all(k.shape[:3] == v.shape[:3] == (2, cfg.num_key_value_heads, 3)
                                                        for k, v in kv)
        set_cache_kv(cache, [(k[1:], v[1:]) for k, v in kv])
        step = model(input_ids=torch.tensor([[7]]), use_cache=True, **{cache_kw: cache}, **last_only).logits
        alone = model(input_ids=torch.tensor([[4, 5, 6, 7]]), **last_only).logits
    torch.testing.assert_close(step, alone, rtol=1e-4, atol=1e-5)
    assert attn_implementation(model) in ("eager", "sdpa")
    model.set_attn_implementation("eager")
    assert attn_implementation(model) == "eager"

    # the fast tokenizer's Python build copies: there after loading, unused once the Rust one is built
    tok = AutoTokenizer.from_pretrained(model_dir)
    assert isinstance(tok._tokenizer, tokenizers.Tokenizer)
    assert isinstance(tok._vocab, dict) and isinstance(tok._merges, list)
    ids = tok("12+34=46").input_ids
    drop_build_copies(tok)
    assert tok._vocab is None and tok._merges is None
    assert tok("12+34=46").input_ids == ids and tok.decode(ids) == "12+34=46"
    tok.save_pretrained(str(tmp_path))          # a checkpoint saves the released tokenizer
    assert AutoTokenizer.from_pretrained(str(tmp_path))("12+34=46").input_ids == ids


def test_a_module_marked_absent_is_not_available_to_transformers(monkeypatch):
    """hide_cuda_media relies on it: None in sys.modules makes find_spec return None, and transformers
    decides a package is there by find_spec."""
    import sys

    from transformers.utils import import_utils

    from transfer.compat.vllm_api import hide_cuda_media

    monkeypatch.setitem(sys.modules, "torchvision", None)
    hide_cuda_media()
    assert sys.modules["torchvision"] is None and importlib.util.find_spec("torchvision") is None
    assert import_utils._is_package_available("torchvision")[0] is False
    with pytest.raises(ImportError):
        import torchvision  # noqa: F401


def test_transformers_cache_forward_attention_and_tokenizer(raw_model_dir, tmp_path):
    transformers_checks(raw_model_dir, tmp_path)


# ---- megatron-core (the `megatron` extra) -----------------------------------------------------
def test_megatron_rng_tracker_names_and_setter():
    pytest.importorskip("megatron.core", reason="megatron-core is not installed (the `megatron` extra)")
    from megatron.core.tensor_parallel import random as mrandom

    from transfer.compat.megatron_api import rng_state_names, set_rng_tracker

    data, model, expert = rng_state_names()
    assert len({data, model, expert}) == 3 and all(isinstance(n, str) for n in (data, model, expert))
    # the model-parallel state is the one megatron's layers fork by default
    assert inspect.signature(mrandom.CudaRNGStatesTracker.fork).parameters["name"].default == model
    saved = mrandom._CUDA_RNG_STATE_TRACKER, mrandom._CUDA_RNG_STATE_TRACKER_INITIALIZED
    tracker = mrandom.CudaRNGStatesTracker()
    try:
        set_rng_tracker(tracker)
        assert mrandom.get_cuda_rng_tracker() is tracker
    finally:
        mrandom._CUDA_RNG_STATE_TRACKER, mrandom._CUDA_RNG_STATE_TRACKER_INITIALIZED = saved


# ---- vLLM (its own venv) -----------------------------------------------------------------------
@pytest.mark.vllm
def test_vllm_internals(raw_model_dir, tmp_path):
    pytest.importorskip("vllm", reason="vLLM is not installed (the `vllm` extra; .ci/run's vLLM tier)")
    import vllm.envs as envs
    from vllm import LLMEngine
    from vllm.inputs import TokensPrompt
    from vllm.model_executor.layers.vocab_parallel_embedding import UnquantizedEmbeddingMethod
    from vllm.v1.worker.cpu_model_runner import CPUModelRunner
    from vllm.v1.worker.cpu_worker import CPUWorker

    from transfer.compat.vllm_api import salted_prompt

    assert {"VLLM_ENABLE_V1_MULTIPROCESSING", "VLLM_CPU_OMP_THREADS_BIND",
            "VLLM_CPU_NUM_OF_RESERVED_CPU"} <= set(envs.environment_variables)
    assert "args" in inspect.signature(LLMEngine.collective_rpc).parameters
    assert callable(CPUWorker.reload_weights) and callable(CPUModelRunner.get_model)
    assert "weights_iterator" in inspect.signature(CPUModelRunner.reload_weights).parameters
    assert callable(UnquantizedEmbeddingMethod.process_weights_after_loading)
    assert set(salted_prompt([1], "v0")) <= TokensPrompt.__required_keys__ | TokensPrompt.__optional_keys__
    transformers_checks(raw_model_dir, tmp_path)        # the pin's oldest transformers: vllm-cpu's


# ---- SGLang (its source, where installed) ------------------------------------------------------
def _classes(tree: ast.Module) -> dict[str, ast.ClassDef]:
    return {n.name: n for n in tree.body if isinstance(n, ast.ClassDef)}


def _fields(cls: ast.ClassDef, classes: dict[str, ast.ClassDef]) -> set[str]:
    """Annotated field names of a class and of its bases defined in the same module."""
    out = {s.target.id for s in cls.body if isinstance(s, ast.AnnAssign) and isinstance(s.target, ast.Name)}
    for b in cls.bases:
        if isinstance(b, ast.Name) and b.id in classes:
            out |= _fields(classes[b.id], classes)
    return out


def sglang_drift(root: Path) -> list[str]:
    """What transfer/compat/sglang_api.py uses that the SGLang source at `root` (the `sglang` package directory)
    lacks: routes, their request fields, sampling fields, meta_info keys, launch flags, the serializer."""
    from transfer.compat.sglang_api import META_FIELDS, ROUTES, SAMPLING_FIELDS, SERVER_FLAGS

    srt = root / "srt"
    missing = []
    server = ast.parse((srt / "entrypoints/http_server.py").read_text())
    handlers = {}       # route -> the handler's parameter annotations, as source
    for fn in ast.walk(server):
        if isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef)):
            for d in fn.decorator_list:
                if isinstance(d, ast.Call) and d.args and isinstance(d.args[0], ast.Constant):
                    handlers[d.args[0].value] = " ".join(ast.unparse(a.annotation) for a in fn.args.args
                                                         if a.annotation is not None)
    io = ast.parse((srt / "managers/io_struct.py").read_text())
    classes = _classes(io)
    for route, (cls, fields) in ROUTES.items():
        if route not in handlers:
            missing.append(f"route {route}")
        elif cls is not None and cls not in handlers[route]:
            missing.append(f"route {route} takes {handlers[route]!r}, not {cls}")
        if cls is not None:
            missing += [f"{cls}.{f}" for f in fields if cls not in classes or f not in _fields(classes[cls], classes)]
    sampling = _classes(ast.parse((srt / "sampling/sampling_params.py").read_text()))["SamplingParams"]
    names = _fields(sampling, {}) | {a.arg for f in sampling.body if isinstance(f, ast.FunctionDef)
                                     and f.name == "__init__" for a in f.args.args + f.args.kwonlyargs}
    missing += [f"SamplingParams.{f}" for f in SAMPLING_FIELDS if f not in names]
    text = "\n".join(p.read_text() for d in ("managers", "utils") for p in (srt / d).rglob("*.py"))
    missing += [f"meta_info {k!r}" for k in META_FIELDS if f'"{k}"' not in text]
    args = "\n".join(p.read_text() for p in [srt / "server_args.py", *srt.glob("arg_groups/**/*.py")])
    missing += [f"--{f}" for f in SERVER_FLAGS if f"    {f.replace('-', '_')}:" not in args]
    serializer = [f for p in srt.glob("utils/*.py") for c in _classes(ast.parse(p.read_text())).values()
                  if c.name == "MultiprocessingSerializer" for f in c.body
                  if isinstance(f, ast.FunctionDef) and f.name == "serialize"]
    if not serializer or "output_str" not in {a.arg for a in serializer[0].args.args}:
        missing.append("MultiprocessingSerializer.serialize(obj, output_str)")
    return missing


def test_sglang_server_api():
    spec = importlib.util.find_spec("sglang")
    if spec is None:
        pytest.skip("SGLang is not installed (the `sglang` extra; GPU machines)")
    assert sglang_drift(Path(spec.origin).parent) == []


def test_the_sglang_engine_sends_only_what_the_tables_name():
    from stages.agentflow.sglang_engine import SGLangEngine, lora_server_args
    from stages.lora_config import LoraConfig
    from transfer.compat.sglang_api import ROUTES, SAMPLING_FIELDS, SERVER_FLAGS, launch_command, request

    assert set(SGLangEngine._sampling({"prompt_ids": [1], "seed": 3}, 4)) <= set(SAMPLING_FIELDS)
    assert set(lora_server_args(LoraConfig(enabled=True), ["q_proj"])) <= set(SERVER_FLAGS)
    assert launch_command({"port": 1, "enable-lora": True, "lora-target-modules": ["q", "v"], "dtype": None})[3:] == [
        "--port", "1", "--enable-lora", "--lora-target-modules", "q", "v"]
    with pytest.raises(ValueError, match="not in transfer/compat"):
        request("POST", "http://127.0.0.1:9", "/generate", {"text": "x"}, 1)
    assert "/generate" in ROUTES
