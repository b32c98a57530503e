"""TransferError: the one loud failure of the transfer package."""
from __future__ import annotations


class TransferError(RuntimeError):
    """A weight transfer failed: a timeout, a checksum mismatch, a dead party or a
    mismatched model. The message always names the receiver, the transport, the version
    and the bucket, so a failed sync is never a silent hang.

    `failures` maps receiver name -> its own TransferError when the mesh aggregates
    several; `metrics` carries what the publish measured before it failed."""

    def __init__(self, reason: str, *, receiver: str, transport: str,
                 version: int | None, bucket: int | None = None,
                 failures: dict[str, "TransferError"] | None = None,
                 metrics: dict | None = None):
        self.reason = reason
        self.receiver = receiver
        self.transport = transport
        self.version = version
        self.bucket = bucket
        self.failures = failures or {}
        self.metrics = metrics or {}
        where = "before any bucket" if bucket is None else f"bucket {bucket}"
        super().__init__(
            f"receiver {receiver!r} via {transport}, version {version}, {where}: {reason}")

    def __reduce__(self):
        # Ray pickles exceptions raised in actors; keyword-only fields need this.
        return (_rebuild, (self.reason, self.receiver, self.transport, self.version,
                           self.bucket, self.failures, self.metrics))


def _rebuild(reason, receiver, transport, version, bucket, failures, metrics):
    return TransferError(reason, receiver=receiver, transport=transport, version=version,
                         bucket=bucket, failures=failures, metrics=metrics)
