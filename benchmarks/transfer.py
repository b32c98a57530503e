"""How fast does the TransferMesh move a state dict, against the physical limit?

    python benchmarks/transfer.py                      # 64M, 256M, 1G state dicts, 1 and 2 receivers
    python benchmarks/transfer.py --sizes 16M,64M      # quicker

GB/s per CPU transport beside memcpy of the same bytes and a naive per-tensor
ray.put/ray.get baseline. Target (issue 4): shm >= 0.5x memcpy and >= 2x naive at 1 GB.
The harness is transfer/bench.py (also `python -m transfer.bench`).
"""
import os
import sys

# The repository, not this folder, goes first on the path: Ray hands the script's folder to
# its workers, where this file would shadow the `transfer` package.
sys.path[0] = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

from transfer.bench import main  # noqa: E402

if __name__ == "__main__":
    main()
