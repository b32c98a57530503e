"""Helpers the test modules share. A test module imports its helpers from here and its fixtures from
conftest.py, never from another test module.

* proxy.py: the proxy's event loop on a thread, the engine client that records what the engine
  returned, an engine whose generate fails.
* scripted.py: the scripted models (real Qwen2s whose weights follow a script), their proxy fixtures
  and the checks that the HF and the vLLM engine both pass behind the proxy.
* engine_checks.py: the engine contract's checks (stages/agentflow/engine_contract.py), one
  engine-agnostic set for the HF, vLLM and SGLang engines.
* runs.py: whole runs: the short-run overrides, the weights an engine actor serves, what a resumed
  run's recorded rollouts must show.
"""
