"""Plan and Placement records: the planner's output and the layout it plans for.

Pure (standard library only). A Plan is one step: which replica of each section handles each
sample, each replica's micro-batches in execution order. Transfers are derived from it (both
ends of an edge know the producer's order, so they agree on the order of sends and receives).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from maestro_flow.samples import SampleMeta

MicroBatches = tuple[tuple[int, ...], ...]
Gates = tuple[tuple[str, int, int], ...]


@dataclass(frozen=True, kw_only=True, slots=True)
class Placement:
    """rank -> (section, replica, device). Ranks are numbered in the graph's topological order."""

    ranks: dict[str, tuple[int, ...]]
    devices: dict[int, str]

    @staticmethod
    def build(order: list[str], dp: dict[str, int], devices: dict[str, list[str]] | None = None) -> Placement:
        ranks: dict[str, tuple[int, ...]] = {}
        rank_devices: dict[int, str] = {}
        next_rank = 0
        for name in order:
            ranks[name] = tuple(range(next_rank, next_rank + dp[name]))
            for replica, rank in enumerate(ranks[name]):
                rank_devices[rank] = (devices or {}).get(name, ["cpu"] * dp[name])[replica]
            next_rank += dp[name]
        return Placement(ranks=ranks, devices=rank_devices)

    @property
    def world_size(self) -> int:
        return sum(len(r) for r in self.ranks.values())

    def dp(self, section: str) -> int:
        return len(self.ranks[section])

    def rank(self, section: str, replica: int) -> int:
        return self.ranks[section][replica]

    def who(self, rank: int) -> tuple[str, int]:
        for name, ranks in self.ranks.items():
            if rank in ranks:
                return name, ranks.index(rank)
        raise KeyError(f"no rank {rank} in placement")

    def to_dict(self) -> dict[str, Any]:
        return {"ranks": {k: list(v) for k, v in self.ranks.items()},
                "devices": {str(k): v for k, v in self.devices.items()}}

    @staticmethod
    def from_dict(d: dict[str, Any]) -> Placement:
        return Placement(ranks={k: tuple(v) for k, v in d["ranks"].items()},
                         devices={int(k): v for k, v in d["devices"].items()})


@dataclass(frozen=True, kw_only=True, slots=True)
class Plan:
    """One step's plan.

    `replicas[section][r]` is replica r's micro-batches (tuples of sample ids) in execution order;
    `routes[section][sample_id]` is the replica of `section` that handles (or, for a section that
    does not activate on the sample, would route) that sample.
    """

    step: int
    schedule: str
    samples: tuple[SampleMeta, ...]
    replicas: dict[str, tuple[MicroBatches, ...]]
    routes: dict[str, dict[int, int]]
    simulated: dict[str, Any] = field(default_factory=dict)
    # Run-ahead credits: gates[section][replica][mb] lists (consumer section, consumer replica,
    # j): that micro-batch may start once the consumer replica has finished j micro-batches of
    # this step. Missing or empty: no gate.
    gates: dict[str, tuple[tuple[Gates, ...], ...]] = field(default_factory=dict)

    def gates_of(self, section: str, replica: int) -> tuple[Gates, ...]:
        reps = self.gates.get(section)
        return reps[replica] if reps else tuple(() for _ in self.replicas[section][replica])

    def micro_batches(self, section: str, replica: int) -> MicroBatches:
        return self.replicas[section][replica]

    def processed(self, section: str) -> list[int]:
        """Every sample id `section` processes this step, replica by replica."""
        return [sid for rep in self.replicas[section] for mb in rep for sid in mb]

    def to_json_dict(self) -> dict[str, Any]:
        """The plan in the format of DESIGN 5.5."""
        return {
            "schedule": self.schedule,
            "step": self.step,
            "sections": {name: {"replicas": [[list(mb) for mb in rep] for rep in reps]}
                         for name, reps in self.replicas.items()},
            "simulated": dict(self.simulated),
            "gates": {name: {"replicas": [[[list(g) for g in mb] for mb in rep] for rep in reps]}
                      for name, reps in self.gates.items()},
        }

    def describe(self) -> str:
        """Readable text form, used by planner tests and `maestro plan` without --json."""
        lines = [f"step {self.step} ({self.schedule})"]
        for name, reps in self.replicas.items():
            for r, mbs in enumerate(reps):
                body = " ".join("[" + ",".join(str(s) for s in mb) + "]" for mb in mbs) or "-"
                lines.append(f"{name}[{r}]: {body}")
        return "\n".join(lines)
