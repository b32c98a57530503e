"""TransferConfig: the `transfer:` section of a recipe, one field per YAML key."""
from __future__ import annotations

from dataclasses import dataclass

# Every transport the mesh knows, fastest first (the order route planning tries them in).
TRANSPORTS = ("inproc", "cuda_ipc", "nccl", "shm", "gloo", "zmq")

# Buckets are checksummed in 4 KiB blocks and sliced into views of any dtype, so their
# size must be a whole number of blocks.
BLOCK_BYTES = 4096


@dataclass(frozen=True)
class TransferConfig:
    # "auto" picks the fastest transport per receiver; any name in TRANSPORTS forces it
    # for every receiver (planning fails loudly if it cannot reach one).
    transport: str = "auto"
    # Size of one bucket: the unit that is packed, checksummed and sent while the next
    # one packs. Large enough to amortise per-message cost, small enough to pipeline.
    # 16 MiB measured best for the CPU transports here; GPU recipes go larger (~1 GiB).
    bucket_bytes: int = 16 << 20
    # The longest any single wait may take (a handshake, one bucket, one load). A
    # transfer as a whole may take longer; no wait ever blocks past this.
    timeout_s: float = 60.0
    # Discovery is the first call an actor answers, so it also waits for the actor to
    # finish starting (loading a model can take minutes).
    discover_timeout_s: float = 600.0
    # Where the sender's shared-memory segment lives (a tmpfs on Linux).
    shm_dir: str = "/dev/shm"
    # Receivers whose target offers weights_in_place (the HF engine does) copy each
    # verified bucket straight into the model while later ones travel, holding the
    # target's lock for the whole receive; False lands the whole version first, then
    # loads it (shorter lock hold, one more pass over the bytes).
    apply_in_place: bool = True
    # A sender with an adopt_fn (the torch trainer) keeps its weights in the shared
    # segment when they are at least this big, so publishing copies nothing. Below it the
    # copy is cheap and keeping the weights private lets the trainer start its next step
    # while local engines are still reading the version (the step loop overlaps them).
    adopt_min_bytes: int = 64 << 20

    def __post_init__(self) -> None:
        if self.transport != "auto" and self.transport not in TRANSPORTS:
            raise ValueError(
                f"transfer.transport={self.transport!r}; valid: auto, {', '.join(TRANSPORTS)}")
        if self.bucket_bytes <= 0 or self.bucket_bytes % BLOCK_BYTES:
            raise ValueError(
                f"transfer.bucket_bytes={self.bucket_bytes} must be a positive multiple of {BLOCK_BYTES}")
        if self.timeout_s <= 0 or self.discover_timeout_s <= 0:
            raise ValueError("transfer.timeout_s and transfer.discover_timeout_s must be positive")
