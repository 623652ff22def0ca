"""TRL on weightsvc: the learner pushes its fp32 masters after each optimizer step, rollouts come from a
`vllm serve` that loads each version through weightsvc's backend, and the loss is computed on the
served copy (Fair Cast). TRL is imported with this package: it is the `trl` extra.

- `WeightsvcTransfer` (with `WeightsvcRollouts`): TRL's `AsyncGRPOTrainer`, through its public doors
  (`weight_transfer=`, `rollout_worker=`, a callback and a forward hook); see `_async`.
- `FairCastGRPOTrainer` (with `WeightsvcSync`): TRL's `GRPOTrainer`, which has no such doors and is
  reached through private names; see `_grpo`.
"""

from weightsvc.integrations.trl._async import WeightsvcRollouts, WeightsvcTransfer
from weightsvc.integrations.trl._grpo import UNKNOWN_VERSION, FairCastGRPOTrainer, WeightsvcSync, token_versions

__all__ = ["UNKNOWN_VERSION", "FairCastGRPOTrainer", "WeightsvcRollouts", "WeightsvcSync", "WeightsvcTransfer",
           "token_versions"]
