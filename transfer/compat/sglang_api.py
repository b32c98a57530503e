"""SGLang's server API as the SGLang engine speaks it (pinned by the `sglang` extra in pyproject.toml;
checked by tests/test_compat.py against the installed release's source).

The native HTTP routes (not the OpenAI-compatible ones) change fields between releases, and the
weight update hands tensors over with SGLang's own serializer; the tables here are what the engine
uses, and `request` refuses a field that is not in them, so the test's check of the tables covers
every call."""
from __future__ import annotations

import sys

# route -> (the request class in sglang/srt/managers/io_struct.py, the fields the engine sends)
ROUTES = {
    "/health_generate": (None, ()),
    "/generate": ("GenerateReqInput", ("input_ids", "sampling_params", "return_logprob", "logprob_start_len",
                                       "lora_path")),
    "/update_weights_from_tensor": ("UpdateWeightsFromTensorReqInput", ("serialized_named_tensors", "flush_cache",
                                                                        "weight_version")),
    "/update_weight_version": ("UpdateWeightVersionReqInput", ("new_version", "abort_all_requests")),
    "/pause_generation": ("PauseGenerationReqInput", ("mode",)),
    "/continue_generation": ("ContinueGenerationReqInput", ()),
    "/abort_request": ("AbortReq", ("abort_all",)),
    "/load_lora_adapter": ("LoadLoRAAdapterReqInput", ("lora_name", "lora_path")),
    "/unload_lora_adapter": ("UnloadLoRAAdapterReqInput", ("lora_name",)),
}
# /generate's sampling_params (SamplingParams' arguments) and meta_info (what parse_output reads)
SAMPLING_FIELDS = ("max_new_tokens", "temperature", "top_p", "skip_special_tokens", "no_stop_trim", "sampling_seed")
META_FIELDS = ("output_token_logprobs", "finish_reason", "weight_versions", "weight_version")
# the launch_server flags the engine passes (ServerArgs' fields, dashes for underscores)
SERVER_FLAGS = ("model-path", "host", "port", "tp-size", "dtype", "random-seed", "mem-fraction-static",
                "weight-version", "skip-tokenizer-init", "context-length", "enable-lora", "max-lora-rank",
                "lora-target-modules", "max-loras-per-batch")


def launch_command(args: dict) -> list[str]:
    """`python -m sglang.launch_server` with `args` as flags: True a bare flag, a list its values, False
    and None left out."""
    cmd = [sys.executable, "-m", "sglang.launch_server"]
    for k, v in args.items():
        if v is True:
            cmd.append(f"--{k}")
        elif isinstance(v, (list, tuple)):
            cmd += [f"--{k}", *map(str, v)]
        elif v is not False and v is not None:
            cmd += [f"--{k}", str(v)]
    return cmd


def request(method: str, url: str, route: str, payload: dict | None, timeout: float):
    """One call of a native route (a `requests` response); ValueError for a route or field not in ROUTES."""
    extra = set(payload or {}) - set(ROUTES[route][1])
    if extra:
        raise ValueError(f"SGLang {route}: {sorted(extra)} not in transfer/compat/sglang_api.py's ROUTES")
    import requests

    return requests.request(method, url + route, json=payload, timeout=timeout)


def serialize_tensors(named: list[tuple]) -> str:
    """(name, CUDA tensor) pairs as /update_weights_from_tensor's `serialized_named_tensors` entry:
    `sglang.srt.utils.MultiprocessingSerializer.serialize(..., output_str=True)` (CUDA IPC handles,
    base64); the server deserializes with its counterpart, so only SGLang's own serializer fits."""
    from sglang.srt.utils import MultiprocessingSerializer

    return MultiprocessingSerializer.serialize(named, output_str=True)
