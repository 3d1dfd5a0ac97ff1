"""The 2-D rank grid of hybrid parallelism: dp_size pipeline replicas of pp_size ranks each.

Vocabulary, one name per idea across ringtrain (the pipeline package, planner and benches):

- `pp_size` (P): ranks in one pipeline, the `--pp-size` flag; `pp_rank`: a rank's place in
  its pipeline, 0..P-1.
- `virtual_stages` (V): stages each pipeline rank holds (interleaving; 1 otherwise).
- `n_stages` (P x V): the model's pieces, numbered 0..n_stages-1 along the chain; a `stage`
  is one of them. The schedule's `stage_ranks[s]` is the pp_rank holding stage s (s mod P
  under interleaving).
- `dp_size` (D): pipeline replicas, averaging gradients with each other; `dp_rank`: which
  replica a rank is in. Under pure data parallelism P = 1, so every rank is one replica.

Consecutive ranks form one pipeline, so with ranks packed by node the chatty point-to-point
traffic stays inside a node and only the once-per-step gradient allreduce crosses nodes.
Pure Python, so the layout can be printed and tested without MPI.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Grid:
    world_size: int
    pp_size: int

    @property
    def dp_size(self) -> int:
        return self.world_size // self.pp_size

    def pp_rank(self, rank: int) -> int:
        return rank % self.pp_size

    def dp_rank(self, rank: int) -> int:
        return rank // self.pp_size

    def pipeline_ranks(self, dp_rank: int) -> list[int]:
        return list(range(dp_rank * self.pp_size, (dp_rank + 1) * self.pp_size))

    def dp_groups(self) -> list[list[int]]:
        """For each pp_rank, the ranks holding it in every replica: whichever stages it holds,
        they average those stages' gradients together."""
        return [[p + d * self.pp_size for d in range(self.dp_size)] for p in range(self.pp_size)]

    def describe(self) -> str:
        lines = [f"grid: {self.dp_size} pipeline replica(s) x {self.pp_size} stage(s)"]
        lines += [f"  pipeline {d}: ranks {self.pipeline_ranks(d)}" for d in range(self.dp_size)]
        lines += [f"  stage {p} replicas: ranks {r}" for p, r in enumerate(self.dp_groups())]
        return "\n".join(lines)
