"""The 2-D rank grid of hybrid parallelism: D pipeline replicas of P ranks each.

`stages` here counts a pipeline's ranks: rank p of each pipeline holds stage p, or under
interleaving the V stages p, p + P, ... (the schedule's stage_ranks), and the replicas of a
position average gradients together whichever stages it holds.

Consecutive ranks form one pipeline, so with ranks packed by node the chatty point-to-point
traffic stays inside a node and only the once-per-step gradient allreduce crosses nodes.
Pure Python, so the layout can be printed and tested without MPI.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Grid:
    world_size: int
    stages: int

    @property
    def replicas(self) -> int:
        return self.world_size // self.stages

    def stage_of(self, rank: int) -> int:
        return rank % self.stages

    def replica_of(self, rank: int) -> int:
        return rank // self.stages

    def pipeline_ranks(self, replica: int) -> list[int]:
        return list(range(replica * self.stages, (replica + 1) * self.stages))

    def stage_sets(self) -> list[list[int]]:
        """For each stage, the ranks holding a replica of it: they average gradients together."""
        return [[s + d * self.stages for d in range(self.replicas)] for s in range(self.stages)]

    def describe(self) -> str:
        lines = [f"grid: {self.replicas} pipeline replica(s) x {self.stages} stage(s)"]
        lines += [f"  pipeline {d}: ranks {self.pipeline_ranks(d)}" for d in range(self.replicas)]
        lines += [f"  stage {s} replicas: ranks {r}" for s, r in enumerate(self.stage_sets())]
        return "\n".join(lines)
