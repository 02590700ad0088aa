"""All runtime timeouts in one place, each overridable by a MAESTRO_* environment variable, and
`env_flag`, which reads the MAESTRO_* switches (MAESTRO_SHM, MAESTRO_CUDA_IPC).

Pure (standard library only). Every blocking call in the runtime takes one of these values;
a timeout error names the variable that changes it (see `errors.TimeoutFailure`).
"""

from __future__ import annotations

import dataclasses
import math
import os
from dataclasses import dataclass


@dataclass(frozen=True, kw_only=True, slots=True)
class Timeouts:
    startup_s: float = 120.0        # spawn -> every worker ready (stage built, groups formed)
    step_s: float = 600.0           # one step's plan sent -> every worker done with it
    hang_s: float = 120.0           # no replica finished a step for this long (or 5x the slowest step): hung
    heartbeat_interval_s: float = 0.5
    heartbeat_timeout_s: float = 10.0  # silence after which a live-looking worker counts as hung
    coordinator_timeout_s: float = 60.0  # silence after which a worker counts its coordinator as gone
    shutdown_grace_s: float = 5.0   # ask -> terminate
    kill_grace_s: float = 2.0       # terminate -> kill
    collective_s: float = 300.0     # torch.distributed op timeout (gloo/NCCL process groups)
    checkpoint_s: float = 600.0     # checkpoint asked -> every worker saved its part

    @staticmethod
    def env_name(field_name: str) -> str:
        return "MAESTRO_" + field_name.upper()

    @classmethod
    def from_env(cls, environ: dict[str, str] | None = None) -> Timeouts:
        environ = dict(os.environ if environ is None else environ)
        values = {}
        for f in dataclasses.fields(cls):
            raw = environ.get(cls.env_name(f.name), "")
            if raw.strip():  # empty counts as unset, as for every MAESTRO_* variable (found in review)
                try:
                    values[f.name] = float(raw)
                except ValueError:
                    values[f.name] = math.nan
                # Found in QA: 'abc' gave a traceback after the run had started; -1 timed out "after
                # 0.0s"; nan and inf were taken, and a deadline of nan never passes.
                if not (math.isfinite(values[f.name]) and values[f.name] > 0):
                    raise ValueError(f"{cls.env_name(f.name)} must be a number of seconds above 0, got {raw!r} "
                                     f"(unset, it is {f.default:g})")
        return cls(**values)

    def to_dict(self) -> dict[str, float]:
        return dataclasses.asdict(self)


OFF, ON = ("0", "false", "no", "off"), ("1", "true", "yes", "on")


def env_flag(name: str, default: bool = True) -> bool:
    """A MAESTRO_* switch: 0/false/no/off or 1/true/yes/on (any case); unset or empty, `default`.
    Anything else is refused (ValueError naming it; found in QA: MAESTRO_SHM=false left shared
    memory on, as only "0" turned it off)."""
    raw = os.environ.get(name, "").strip().lower()
    if raw in OFF or raw in ON or not raw:
        return raw in ON or (not raw and default)
    raise ValueError(f"{name} must be one of {'/'.join(OFF)} (off) or {'/'.join(ON)} (on), got {os.environ[name]!r}")
