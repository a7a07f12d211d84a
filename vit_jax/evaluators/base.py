"""What every evaluator shares: the interface and moving batches onto the mesh.

An evaluator is built once per run from its config section and the model,
then called with the current parameters; it returns flat scalar metrics
(`{'fewshot/mnist5k/5shot': 0.81, ...}`) for metrics.jsonl and summary.json.
Each runs every `every` steps (0: at the end of training only) and in
`--config.mode=eval`.
"""

from __future__ import annotations

import abc
from typing import Any, Dict

import jax
import numpy as np

from vit_jax.train import sharding as shd


class Evaluator(abc.ABC):
  """One evaluation of a set of parameters."""

  name: str
  every: int = 0

  @abc.abstractmethod
  def run(self, params: Any) -> Dict[str, float]:
    """Metrics of `params` (a sharded parameter tree)."""

  def due(self, step: int, total_steps: int) -> bool:
    """Whether to run after `step` (the final step is handled by the loop)."""
    return bool(self.every) and step % self.every == 0 and step < total_steps


def global_batch(batch: Dict[str, np.ndarray], mesh) -> Dict[str, jax.Array]:
  """Process-local numpy batch -> global arrays split over (data, fsdp)."""
  return {k: jax.make_array_from_process_local_data(
      shd.batch_sharding(mesh, v.ndim), v) for k, v in batch.items()}
