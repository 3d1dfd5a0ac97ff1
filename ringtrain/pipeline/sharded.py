"""--shard-optimizer in hybrid: the replicas of each stage (its Horovod process set) share
that stage's optimizer slots as data-parallel replicas share the whole model's. REDUCE leaves
the stage's gradient sums as they are, and STEP reduce-scatters them within the stage's
replicas, updates the rank's own variables, and all-gathers them (dataparallel.sharded)."""

from __future__ import annotations

from ringtrain.dataparallel.sharded import (
    ShardedCheckpoint,
    ShardedUpdate,
    shard_groups,
)
from ringtrain.errors import UserError
from ringtrain.pipeline.engine import PipelineEngine
from ringtrain.tensorflow_loader import tf


class ShardedPipelineEngine(ShardedCheckpoint, PipelineEngine):
    """A hybrid grid whose stage replicas each hold 1/D of their stage's optimizer slots."""

    def _stepping_optimizer(self):
        if self.clip_limit is not None:
            raise UserError(
                "--shard-optimizer in pipeline stages does not clip by the global norm yet "
                "(--clip-norm, or global_clipnorm in compile())"
            )
        cfg = self.cfg
        self.update = ShardedUpdate(
            self.world.hvd,
            self.optimizer,
            self.variables,
            self.dp_rank,
            self.dp_size,
            cfg.fp16_allreduce,
            cfg.bucket_mb,
            process_set=self.stage_set,
        )
        self.nothing = tf.constant(0.0)
        return self.update.optimizer

    def _average_over_replicas(self, grads: list) -> list:
        return grads  # reduce-scattered at STEP instead

    def _apply_gradients(self, grads: list) -> None:
        self.update.apply(grads, self.nothing, self.nothing)

    @property
    def replica(self) -> int:
        return self.dp_rank

    def checkpoint_meta(self) -> dict:
        """Every stage's group, as rank 0 (which writes the manifest) can name them all."""
        holders = [self.schedule.stages_on(p) for p in range(self.pp_size)]
        return shard_groups(["stage" + "+".join(map(str, h)) for h in holders], self.dp_size)
