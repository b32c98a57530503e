"""TransferError: the one loud failure of the transfer package."""
from __future__ import annotations

import functools


class TransferError(RuntimeError):
    """A weight transfer failed: a timeout, a checksum mismatch, a dead party or a mismatched model.
    The message names the receiver, the transport, the version and the bucket. `failures` maps
    receiver -> its own TransferError when the mesh aggregates several; `metrics` carries what the
    publish measured before it failed."""

    def __init__(self, reason: str, *, receiver: str, transport: str, version: int | None, bucket: int | None = None,
                 failures: dict[str, "TransferError"] | None = None, metrics: dict | None = None):
        self.reason, self.receiver, self.transport, self.version = reason, receiver, transport, version
        self.bucket, self.failures, self.metrics = bucket, failures or {}, metrics or {}
        where = "before any bucket" if bucket is None else f"bucket {bucket}"
        super().__init__(f"receiver {receiver!r} via {transport}, version {version}, {where}: {reason}")

    def __reduce__(self):       # Ray pickles exceptions raised in actors; keyword-only fields need this
        fields = ("receiver", "transport", "version", "bucket", "failures", "metrics")
        return functools.partial(TransferError, **{k: getattr(self, k) for k in fields}), (self.reason,)
