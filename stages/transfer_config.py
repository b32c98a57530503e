"""TransferConfig: the `transfer:` section of a recipe, one field per YAML key (transfer/ reads it, imports none)."""
from __future__ import annotations

from stages.keys import NONNEG, POSITIVE, Check, key, one_of, section
from transfer.config import BLOCK_BYTES, TRANSPORTS

_BUCKET = Check(f"a positive multiple of {BLOCK_BYTES}", lambda n: n > 0 and n % BLOCK_BYTES == 0)


@section("transfer")
class TransferConfig:
    transport: str = key("auto", '"auto" picks the fastest transport per receiver; any name in TRANSPORTS forces it '
                                 "for every receiver (planning fails loudly if it cannot reach one)",
                                 one_of("auto", *TRANSPORTS))
    bucket_bytes: int = key(16 << 20, "size of one bucket: the unit packed, checksummed and sent while the next one "
                                      "packs (GPU recipes go larger, ~1 GiB)", _BUCKET)
    timeout_s: float = key(60.0, "the longest any single wait may take (a handshake, one bucket, one load); a transfer"
                                 " as a whole may take longer", POSITIVE)
    discover_timeout_s: float = key(600.0, "discovery is the first call an actor answers, so it also waits for the "
                                           "actor to finish starting (loading a model can take minutes)", POSITIVE)
    shm_dir: str = key("/dev/shm", "where the sender's shared-memory segment lives (a tmpfs on Linux)")
    apply_in_place: bool = key(True, "receivers whose target offers weights_in_place (the HF engine does) copy each "
                                     "verified bucket straight into the model while later ones travel, holding the "
                                     "target's lock for the whole receive; False lands the whole version first, then "
                                     "loads it (shorter lock hold, one more copy of the weights in memory)")
    adopt_min_bytes: int = key(64 << 20, "a sender with an adopt_fn (the torch trainer) keeps its weights in the "
                                         "shared segment when they are at least this big, so publishing copies "
                                         "nothing; below it the copy is cheap and private weights let the trainer "
                                         "start its next step while local engines still read the version", NONNEG)
