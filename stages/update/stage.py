"""Update stage: one step's trajectories -> one optimizer update on the trainer actor.

Input columns: prompt_ids, response_ids, response_logprobs, loss_mask, token_versions,
               reward, group_id, status
Output: the step's training metrics (a dict), not rows.

It runs on the driver side of the stream: the trainer is an actor (group) that holds the
weights; this stage only ships the Arrow table and waits for the metrics.
"""
from __future__ import annotations

import pyarrow as pa
import ray


class Update:
    inputs = ("prompt_ids", "response_ids", "response_logprobs", "loss_mask", "token_versions",
              "reward", "group_id", "status")
    outputs: tuple = ()

    def __init__(self, trainer):
        self.trainer = trainer

    def submit(self, batch) -> ray.ObjectRef:
        """Start the update (batch: a table, or its object ref); returns the metrics' ref."""
        return self.trainer.train_step.remote(batch)

    def __call__(self, batch: pa.Table) -> dict:
        return ray.get(self.submit(batch))
