"""The transports the mesh knows and its bucket unit (the recipe's `transfer:` section: stages/transfer_config.py)."""
from __future__ import annotations

# Every transport the mesh knows, fastest first (the order route planning tries them in).
TRANSPORTS = ("inproc", "cuda_ipc", "nccl", "shm", "gloo", "zmq")

# Buckets are checksummed in 4 KiB blocks and sliced into views of any dtype, so their
# size must be a whole number of blocks.
BLOCK_BYTES = 4096
