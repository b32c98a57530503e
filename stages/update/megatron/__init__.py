"""Megatron-core trainer backend: the torch trainer's update on a TP x PP x DP model. Everything but
config.py (the `megatron:` section, parsed anywhere) needs megatron-core (pip extra `megatron`).
"""
