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
    """rank -> (section, replica, device). Ranks are numbered in the graph's topological order.

    `ranks[section][r]` is the *leader* rank of replica r: the one the planner and the transfers
    know. A replica with tensor parallelism is a group of ranks, `members[leader]` (leader
    first, consecutive ranks); without, it is the leader alone.
    """

    ranks: dict[str, tuple[int, ...]]
    devices: dict[int, str]
    members: dict[int, tuple[int, ...]] = field(default_factory=dict)
    # rank -> (section, replica, index in its replica): built once, so `who` is a lookup (the
    # coordinator asks it for every report of every rank, every step).
    _where: dict[int, tuple[str, int, int]] = field(default_factory=dict, init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        for name, leaders in self.ranks.items():
            for replica, leader in enumerate(leaders):
                for i, rank in enumerate(self.members.get(leader, (leader,))):
                    self._where[rank] = (name, replica, i)

    @staticmethod
    def build(order: list[str], dp: dict[str, int], devices: dict[str, list[str]] | None = None,
              tp: dict[str, int] | None = None) -> Placement:
        """`devices[section]` lists one device per rank of the section (dp * tp of them)."""
        ranks: dict[str, tuple[int, ...]] = {}
        members: dict[int, tuple[int, ...]] = {}
        rank_devices: dict[int, str] = {}
        next_rank = 0
        for name in order:
            size = (tp or {}).get(name, 1)
            leaders = []
            for replica in range(dp[name]):
                group = tuple(range(next_rank, next_rank + size))
                leaders.append(group[0])
                members[group[0]] = group
                for i, rank in enumerate(group):
                    rank_devices[rank] = (devices or {}).get(name, ["cpu"] * dp[name] * size)[replica * size + i]
                next_rank += size
            ranks[name] = tuple(leaders)
        return Placement(ranks=ranks, devices=rank_devices, members=members)

    @property
    def world_size(self) -> int:
        return len(self.devices)

    def dp(self, section: str) -> int:
        return len(self.ranks[section])

    def tp(self, section: str) -> int:
        return len(self.group(self.ranks[section][0]))

    def rank(self, section: str, replica: int) -> int:
        """The leader rank of a replica."""
        return self.ranks[section][replica]

    def group(self, leader: int) -> tuple[int, ...]:
        """Every rank of the replica `leader` leads (leader first)."""
        return self.members.get(leader, (leader,))

    def section_ranks(self, section: str) -> list[int]:
        """Every rank of a section: replica by replica, leader first."""
        return [r for leader in self.ranks[section] for r in self.group(leader)]

    def who(self, rank: int) -> tuple[str, int]:
        """(section, replica) of any rank, leader or not."""
        where = self._where.get(rank)
        if where is None:
            raise KeyError(f"no rank {rank} in placement")
        return where[0], where[1]

    def tp_index(self, rank: int) -> int:
        """The rank's place in its replica's tensor-parallel group (0: the leader)."""
        where = self._where.get(rank)
        if where is None:
            raise KeyError(f"no rank {rank} in placement")
        return where[2]

    def worker_name(self, rank: int, sep: str = "-") -> str:
        """"student-1" (replica 1), "student-1.2" (its third tensor-parallel rank), for logs."""
        section, replica = self.who(rank)
        tp_index = self.tp_index(rank)
        return f"{section}{sep}{replica}" + (f".{tp_index}" if self.tp(section) > 1 else "")

    def to_dict(self) -> dict[str, Any]:
        return {"ranks": {k: list(v) for k, v in self.ranks.items()},
                "devices": {str(k): v for k, v in self.devices.items()},
                "members": {str(k): list(v) for k, v in self.members.items()}}

    @staticmethod
    def from_dict(d: dict[str, Any]) -> Placement:
        return Placement(ranks={k: tuple(v) for k, v in d["ranks"].items()},
                         devices={int(k): v for k, v in d["devices"].items()},
                         members={int(k): tuple(v) for k, v in d.get("members", {}).items()})


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
    # Which rules produced the order, where a planner tries several (the wavefront names its
    # winning candidate per component, "fifo" where FIFO's order simulated shorter).
    variant: str = ""

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
            "variant": self.variant,
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
