"""What every evaluator shares: the interface.

An evaluator is built once per run from its config section and the model,
then called with the current parameters; it returns flat scalar metrics
(`{'fewshot/mnist5k/5shot': 0.81, ...}`) for metrics.jsonl and summary.json.
Each runs every `every` steps (0: at the end of training only) and in
`--config.mode=eval`.
"""

from __future__ import annotations

import abc
from typing import Any, Dict


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
