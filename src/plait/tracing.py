"""The names plait gives its work in a profiler trace, written by the runtime and read by
`plait analyze` (one definition for both sides).

- `plait:<call>:<plan op>`: one op of a schedule's lowering (`plait.schedule.lower`) inside call
  `<call>` (e.g. `plait:ag_mm#3:gemm.1`, `plait:ag_mm#3:x.0.1`); a GEMM piece's plan op starts
  with `gemm.`, a whole GEMM (a sequential schedule) is `gemm`.
- `plait:copy <call> <transfer>`: one copy of the CPU copy engine, on its copier thread.
- `plait:call <op> <label> <schedule> <m>x<n>x<k> p<ranks> <dtype> <engine>`: one whole call
  of a plait op, with the schedule and engine that ran and its GEMM (per rank: m rows, n
  columns, k reduction) over `ranks` ranks: what `plait analyze` grades against a plan.
- `plait:check <op>`: the runtime's cross-rank check of a call's shapes and schedule (a small
  all-gather): plait's own overhead, which `plait analyze` labels as such.
- `plait:F<stage>.<micro-batch>`, `plait:B<stage>.<micro-batch>`: the forward and backward
  strands of plait's `OVERLAP_F_B` (`plait.pipelining`), each on its own thread.
- Pipeline actions as PyTorch's runtime schedules name them (`PP:0F3`, `PP:1B2`,
  `PP:(0F2;3B0)OVERLAP_F_B`; `Forward 3` / `Backward 3` for `Schedule1F1B`), which
  `pipeline_action_range` writes where PyTorch records none.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

PREFIX = "plait:"
COPY = "plait:copy "
CHECK = "plait:check "


def op_range(call: str, plan_op: str) -> str:
    """The range name of plan op `plan_op` of call `call`."""
    return f"{PREFIX}{call}:{plan_op}"


CALL = "plait:call "


@dataclass(frozen=True, slots=True)
class Call:
    """One call of a plait op as its range names it."""

    op: str  # all_gather_matmul, matmul_reduce_scatter, all_to_all_matmul, matmul_all_to_all
    label: str  # which call: ag_mm, mm_rs.bwd, ...
    schedule: str
    engine: str
    m: int
    n: int
    k: int
    ranks: int
    dtype: str

    def range(self) -> str:
        return (f"{CALL}{self.op} {self.label} {self.schedule} {self.m}x{self.n}x{self.k} "
                f"p{self.ranks} {self.dtype} {self.engine}")


_CALL = re.compile(r"^plait:call (\S+) (\S+) (\S+) (\d+)x(\d+)x(\d+) p(\d+) (\S+) (.+)$")


def parse_call(name: str) -> Call | None:
    """The call a `plait:call` range names, or None for any other range."""
    m = _CALL.match(name)
    if m is None:
        return None
    op, label, schedule, mm, n, k, ranks, dtype, engine = m.groups()
    return Call(op, label, schedule, engine, int(mm), int(n), int(k), int(ranks), dtype)


def copy_range(what: str) -> str:
    """The range name of one copy-engine copy (`what`: the call and the transfer)."""
    return f"{COPY}{what}"


def check_range(op: str) -> str:
    """The range name of the runtime's cross-rank check of one call of `op`."""
    return f"{CHECK}{op}"


def is_check(name: str) -> bool:
    return name.startswith(CHECK)


def is_copy(name: str) -> bool:
    return name.startswith(COPY)


def is_gemm_piece(name: str) -> bool:
    """A range around one GEMM piece of a decomposed schedule (not a whole GEMM)."""
    return name.startswith(PREFIX) and ":gemm." in name


def strand_range(kind: str, stage: int, micro_batch: int) -> str:
    """The range of one strand of plait's OVERLAP_F_B: `kind` "F" (forward) or "B"."""
    return f"{PREFIX}{kind}{stage}.{micro_batch}"


def pipeline_action_range(stage: int, kind: str, micro_batch: int) -> str:
    """A pipeline action named as PyTorch's runtime schedules name it (`PP:0F3`)."""
    return f"PP:{stage}{kind}{micro_batch}"


_ACTION = re.compile(r"^(PP:(\d+([FBIW])\d+|\(.*\)OVERLAP_F_B)|(Forward|Backward) \d+|"
                     r"plait:([FB])\d+\.\d+)$")
_CATEGORY = {"F": "forward", "B": "backward", "I": "backward (input)", "W": "weight gradient",
             "Forward": "forward", "Backward": "backward"}


def pipeline_action(name: str) -> tuple[str, str] | None:
    """A pipeline action's (category, strand) from its range name, None for any other range.
    The strand is "forward" or "backward" for plait's OVERLAP_F_B strands, else ""."""
    m = _ACTION.match(name)
    if m is None:
        return None
    if "OVERLAP" in name:
        return "forward + backward", ""
    strand = m.group(5)
    key = m.group(3) or m.group(4) or strand
    return _CATEGORY[key], "" if strand is None else _CATEGORY[strand]


def every_thread() -> Any:
    """A torch.profiler `experimental_config` that records every thread, so that the copies of
    plait's CPU copy engine (its copier thread) are in the trace:
    `torch.profiler.profile(record_shapes=True, experimental_config=every_thread())`."""
    import torch

    return torch._C._profiler._ExperimentalConfig(profile_all_threads=True)
