"""Every private API of a foreign library the project relies on, one module per library: torch_api,
ray_api, transformers_api, vllm_api, sglang_api, megatron_api.

A library's internals change without notice between releases, so each use of one lives here behind
a function whose docstring names what it reads or replaces and why no public API does it. Each
library is pinned in pyproject.toml to the releases these modules were written against, and
tests/test_compat.py checks, on the installed releases, that every internal used here is still
there and behaves as relied on: an upgrade that changes one fails there, not in a run.

The bottom layer: it imports no module of the project, and every layer may import it. Its modules
import their library inside the functions, so importing one costs nothing.
"""
