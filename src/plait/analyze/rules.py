"""Which GPU kernels are communication, by rule, and what kind of transfer each one is.

A kernel is communication when one rule matches its name (first match wins, user rules
first); the rule's name travels with the transfer so the report can say how much time each rule
found. Built in:
- `nccl/rccl`: NCCL's and RCCL's kernels (`ncclDevKernel_*`, `ncclKernel_*`, `rccl*`), and
  any kernel Kineto annotated with a `Collective name`;
- `symmetric memory`: PyTorch's symmetric-memory collectives (async TP's `symm_mem`,
  `multimem_*`, one-/two-shot all-reduce);
- `userbuffers`: TransformerEngine's comm-GEMM overlap;
- `expert parallel`: DeepEP-style dispatch/combine kernels (`deep_ep::intranode::*`,
  `deep_ep::internode::*`, `deep_ep::internode_ll::*` and forks of it), and NVSHMEM's;
- `peer memcpy`: peer-to-peer memory copies (copy engines or NVLink), not local ones.
A `--comm-kernel REGEX` adds a rule named `user: REGEX`.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass
from functools import lru_cache

from plait.errors import SpecError
from plait.workload.operators import CollectiveKind

_KINDS = (  # (pattern over a collective's or kernel's name, kind), first match wins
    (r"all_?gather|allgather", CollectiveKind.AG),
    (r"reduce_?scatter|reducescatter", CollectiveKind.RS),
    (r"all_?reduce|allreduce", CollectiveKind.AR),
    (r"all_?to_?all|alltoall|dispatch|combine", CollectiveKind.A2A),
    (r"send|recv|ptop", CollectiveKind.P2P),
)
# readable names of the collectives plait has no model of, by pattern over the name
_OTHER = ((r"broadcast", "broadcast"), (r"reduce", "reduce"), (r"gather", "gather"),
          (r"scatter", "scatter"), (r"barrier", "barrier"), (r"notify", "notify"))


@dataclass(frozen=True, slots=True)
class CommRule:
    name: str
    pattern: re.Pattern[str]


BUILT_IN = (
    CommRule("nccl/rccl", re.compile(r"^(void )?(nccl|rccl)", re.IGNORECASE)),
    CommRule("symmetric memory", re.compile(
        r"multimem_|one_shot_all_reduce|two_shot_all_reduce|symm_mem", re.IGNORECASE)),
    CommRule("userbuffers", re.compile(r"userbuffers", re.IGNORECASE)),
    CommRule("expert parallel", re.compile(
        r"::(intra|inter)node(_ll)?::\w*(dispatch|combine|notify)|\bnvshmemi?_",
        re.IGNORECASE)),
)
PEER_MEMCPY = "peer memcpy"
BY_COPY_ENGINE = "by copy engine"  # a peer copy launched inside a collective's call
ANNOTATED = "nccl/rccl"  # a kernel Kineto annotated with a collective's name
PLAIT_CHECK = "plait: shape check"  # the runtime's own cross-rank check (its overhead)


def user_rules(patterns: Sequence[str]) -> tuple[CommRule, ...]:
    """`--comm-kernel` patterns as rules; a pattern that is not a regular expression is refused."""
    out = []
    for p in patterns:
        try:
            out.append(CommRule(f"user: {p}", re.compile(p, re.IGNORECASE)))
        except re.error as exc:
            raise SpecError("--comm-kernel", f"{p!r} is not a regular expression ({exc})",
                            "pass a Python regular expression over kernel names, e.g. "
                            "'my_a2a_kernel|allgather'") from exc
    return tuple(out)


@lru_cache(maxsize=1 << 16)
def matching_rule(name: str, rules: tuple[CommRule, ...]) -> str | None:
    """The name of the first rule whose pattern occurs in kernel name `name` (kernel names
    repeat: each is matched once)."""
    return next((r.name for r in rules if r.pattern.search(name)), None)


def kind_of(name: str) -> CollectiveKind | None:
    low = name.lower()
    return next((k for pat, k in _KINDS if re.search(pat, low)), None)


def label_of(name: str, kind: CollectiveKind | None) -> str:
    """What a transfer is, readably: plait's kind; else the collective's name (broadcast,
    reduce, ...); else the kernel's own short name (its function name, no template or
    arguments)."""
    if kind is not None:
        return kind.value
    low = name.lower()
    other = next((label for pat, label in _OTHER if re.search(pat, low)), None)
    if other is not None:
        return other
    return short_name(name)


def short_name(name: str) -> str:
    """A kernel's function name without its return type, template arguments and parameters:
    `void ns::f<8, true>(int*, ...)` -> `ns::f`."""
    s = re.sub(r"^void\s+", "", name.strip()).replace("(anonymous namespace)::", "")
    depth, out = 0, []
    for ch in s:
        if ch in "<(":
            if ch == "(" and depth == 0:
                break
            depth += 1
        elif ch in ">)":
            depth = max(0, depth - 1)
        elif depth == 0:
            out.append(ch)
    return "".join(out).strip() or name[:60]


@lru_cache(maxsize=1 << 16)
def display_name(name: str, width: int = 64) -> str:
    """A kernel's name for a table: no return type or parameter list, templates kept (they
    tell `cutlass::device_kernel<...>`s apart), cut to `width` characters."""
    s = re.sub(r"^void\s+", "", name.strip()).replace("(anonymous namespace)::", "")
    depth = 0
    for i, ch in enumerate(s):
        if ch == "<":
            depth += 1
        elif ch == ">":
            depth = max(0, depth - 1)
        elif ch == "(" and depth == 0 and i > 0:
            s = s[:i]
            break
    return s if len(s) <= width else s[:width - 1] + "…"
