"""The search of `plait plan`: every layout (`space.layouts`) that fits one GPU's memory,
ranked by predicted step time.

Full activation checkpointing recomputes the fewest of a rank's layers that fit (Megatron-LM's
`recompute_num_layers`): each one recomputed costs time and saves memory, so the least that
fits is the fastest; where recomputing none fits, the layout without checkpointing is that run.
A pinned `ac` or `ac_layers` (`--layout`) is taken as given.

Exhaustive where the space is small; where it is not, branch and bound: the layouts that fit
are ordered by a lower bound of their step (their compute alone, bubble included:
`Job.bound_s`) and predicted in that order, until the next bound is slower than the `keep`-th
best prediction so far; the rest cannot enter the ranking and are counted as pruned. A
co-executed layout is priced by its pair's overlap bound, and once it would enter the
ranking, by its pair's simulated plan (`Job.pair_s(planned=True)`, a fraction of a second
per layer shape), so the ranking holds planned figures and the bound still prunes soundly.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import cast

from plait.errors import InfeasibleError, SpecError
from plait.planner.plan.space import (
    AC_MODES,
    COEXEC_NEEDS,
    MIN_CP_TOKENS,
    OVERLAP_KINDS,
    OVERLAPS,
    PIPELINE_KINDS,
    ZERO_STAGES,
    Layout,
    Overlap,
    can_overlap,
    layouts,
    stage_layers,
)
from plait.planner.plan.step import Job, Prediction


@dataclass(frozen=True)
class PlanResult:
    job: Job
    ranked: tuple[Prediction, ...]  # best first, those that fit
    considered: int  # layouts enumerated
    fitting: int  # of them within memory
    predicted: int  # of those, predicted in full (the rest pruned by their bound)
    too_big: tuple[Prediction, ...] = ()  # the given layout, when it does not fit
    # layouts that cannot run (a pair no schedule can cut, say): (layout, why), left out
    cannot_run: tuple[tuple[str, str], ...] = ()

    @property
    def chosen(self) -> Prediction | None:
        return self.ranked[0] if self.ranked else None

    @property
    def pruned(self) -> int:
        return self.fitting - self.predicted - len(self.cannot_run)


def plan(job: Job, keep: int = 10, fixed: dict[str, object] | None = None,
         progress: Callable[[int, int], None] | None = None) -> PlanResult:
    """The `keep` fastest layouts of `job` that fit (best first), searched as the module says;
    `fixed` pins layout fields (`--layout`; a pinned `overlap` is the only one tried);
    `progress(done, total)` after each prediction."""
    fixed = dict(fixed or {})
    pinned: tuple[Overlap, ...] | None = ((fixed.pop("overlap"),)  # type: ignore[assignment]
                                          if "overlap" in fixed else None)
    all_layouts = list(layouts(job.model, job.cluster, job.gpus, job.seq_len, job.global_batch,
                               fixed=fixed))
    if "ac" not in fixed and "ac_layers" not in fixed:
        all_layouts = [least for lay in all_layouts
                       if (least := _least_recompute(job, lay)) is not None]
    if not all_layouts:
        check_fixed(job, fixed)
        raise InfeasibleError(
            f"no layout of {job.model.name} on {job.gpus} GPUs runs {job.global_batch} "
            f"sequences of {job.seq_len} tokens" + (f" with {fixed}" if fixed else "")
            + ". Fix: choose a global batch divisible by the data-parallel size, or other "
            "fixed fields")
    if pinned is not None:
        all_layouts = [lay for lay in all_layouts if can_overlap(lay, pinned[0])]
        if not all_layouts:
            raise InfeasibleError(
                f"no layout with {fixed} can run overlap {pinned[0]}. Fix: {COEXEC_NEEDS}")
    fit = [lay for lay in all_layouts if job.memory(lay).total <= job.memory_bytes]
    if not fit:
        smallest = min(all_layouts, key=lambda lay: job.memory(lay).total)
        try:
            return PlanResult(job, (), len(all_layouts), 0, 0,
                              (job.predict(smallest, pinned or OVERLAPS),))
        except InfeasibleError as exc:
            return PlanResult(job, (), len(all_layouts), 0, 0,
                              cannot_run=((_name(smallest), str(exc)),))
    cannot_run: list[tuple[str, str]] = []
    bounded = sorted(((job.bound_s(lay), lay) for lay in fit), key=lambda x: x[0])
    best: list[Prediction] = []
    done = 0
    for bound, lay in bounded:
        if len(best) >= keep and bound > best[keep - 1].step_s:
            break
        try:
            p = _fitting(job, lay, pinned=pinned)
            if len(best) < keep or p.step_s < best[-1].step_s:  # entering the ranking
                p = _planned(job, p, pinned)
        except InfeasibleError as exc:  # this layout cannot run: left out, never the end
            cannot_run.append((_name(lay), str(exc)))
            continue
        finally:
            done += 1
            if progress is not None:
                progress(done, len(bounded))
        if p.fits:
            best = sorted([*best, p], key=lambda x: x.step_s)[:keep]
    return PlanResult(job, tuple(best), len(all_layouts), len(fit), done - len(cannot_run),
                      cannot_run=tuple(cannot_run))


def _planned(job: Job, p: Prediction, pinned: tuple[Overlap, ...] | None) -> Prediction:
    """`p` again with a co-executed pair as its plan simulates it (`Job.pair_s(planned=
    True)`), where `p` co-executes; else `p`."""
    if p.layout.overlap != "coexec":
        return p
    return _fitting(job, dataclasses.replace(p.layout, overlap="plain"), planned=True,
                    pinned=pinned)


def _name(lay: Layout) -> str:
    """A layout as the ranking's table names it: its ranks and its batches."""
    return f"{lay.label()} {lay.micro_batch}x{lay.micro_batches}"


def _least_recompute(job: Job, lay: Layout) -> Layout | None:
    """`lay` under full checkpointing on the fewest of its rank's layers that fit (memory
    falls with each layer checkpointed: bisected); `lay` itself where even all do not fit or
    it checkpoints nothing or selectively; None where checkpointing no layer fits (the same
    run as the layout without checkpointing)."""
    if lay.ac != "full" or job.memory(lay).total > job.memory_bytes:
        return lay
    if job.memory(dataclasses.replace(lay, ac="none")).total <= job.memory_bytes:
        return None
    layers = stage_layers(job.model, lay)
    low, high = 1, layers  # high fits
    while low < high:
        mid = (low + high) // 2
        if job.memory(dataclasses.replace(lay, ac_layers=mid)).total <= job.memory_bytes:
            high = mid
        else:
            low = mid + 1
    return dataclasses.replace(lay, ac_layers=high if high < layers else 0)


def _fitting(job: Job, lay: Layout, planned: bool = False,
             pinned: tuple[Overlap, ...] | None = None) -> Prediction:
    """The layout's fastest overlap whose buffers still fit (co-execution's second live
    micro-batch, FiCCO's staging buffers), plain as the last resort; a `pinned` overlap
    only (a layout it does not fit is reported as not fitting)."""
    tries: tuple[tuple[Overlap, ...], ...] = ((pinned,) if pinned is not None else
                                              (OVERLAPS, ("plain", "ficco"), ("plain",)))
    for overlaps in tries:
        p = job.predict(lay, overlaps, planned)
        if p.memory.total <= job.memory_bytes:
            return p
    return p


# The words a text field of a layout takes, and what it names
_WORDS: dict[str, tuple[str, ...]] = {"ac": AC_MODES, "schedule": PIPELINE_KINDS,
                                      "overlap": OVERLAP_KINDS}


def parse_layout(text: str) -> dict[str, object]:
    """`tp=8,pp=2,ac=full` -> the fields it pins; a wrong, repeated or impossible field or
    value raises `SpecError` naming it (numbers in ASCII digits, 1 or more; ac_layers 0 or
    more; words among those a field takes)."""
    fields = {f.name: type(getattr(Layout(), f.name)) for f in dataclasses.fields(Layout)}
    out: dict[str, object] = {}
    for item in filter(None, (s.strip() for s in text.split(","))):
        name, eq, raw = item.partition("=")
        name, value = name.strip().replace("-", "_"), raw.strip()
        if not eq or name not in fields:
            raise SpecError("layout", f"{item!r} is not a layout field=value",
                            f"use {', '.join(fields)} as tp=8,pp=2,ac=full")
        if name in out:
            raise SpecError(f"layout.{name}", f"given twice ({name}={out[name]}, "
                            f"{name}={value})", f"give {name} once")
        if name in _WORDS:
            if value not in _WORDS[name]:
                raise SpecError(f"layout.{name}", f"{value!r} is not one of "
                                f"{', '.join(_WORDS[name])}",
                                f"write {name}={'|'.join(_WORDS[name])}")
            out[name] = value
            continue
        least = 0 if name == "ac_layers" else 1
        if not re.fullmatch(r"[0-9]{1,9}", value) or int(value) < least:
            raise SpecError(f"layout.{name}", f"{value!r} is not a whole number of {least} or "
                            "more (ASCII digits)", f"write {name}=<integer>")
        out[name] = int(value)
    if out.get("zero", 1) not in ZERO_STAGES:
        raise SpecError("layout.zero", f"ZeRO stage {out['zero']} is not modelled",
                        f"write zero={'|'.join(map(str, ZERO_STAGES))} (1: Megatron-LM's "
                        "distributed optimizer; 3: FSDP)")
    if out.get("ac_layers", 0) and out.get("ac", "full") != "full":
        raise SpecError("layout.ac_layers", "ac_layers counts the layers of a rank under full "
                        "checkpointing (0: all)", "write ac=full,ac_layers=<0 or more>")
    return out


# The order in which `check_fixed` pins fields, and the rule each one follows
_RULES: dict[str, str] = {
    "tp": "TP splits the heads, the key/value heads (or is a multiple of them) and the MLP "
          "evenly, divides the GPUs and stays within one node",
    "cp": "CP is a power of two dividing the GPUs TP leaves, and keeps at least "
          f"{MIN_CP_TOKENS:,} tokens of a sequence, a multiple of tp, on each rank",
    "pp": "PP divides the GPUs TP x CP leave and keeps two layers or more a stage",
    "dp": "dp is what TP x CP x PP leave of the GPUs",
    "ep": "EP divides the experts and the dp x cp x tp ranks it is carved from (1 on a "
          "dense model)",
    "micro_batch": "a micro-batch's sequences divide a data-parallel rank's share of the "
                   "global batch, and its tokens split over TP",
    "micro_batches": "micro_batches = global batch / (dp x micro_batch), at least pp (2 x pp "
                     "for DualPipeV, a multiple of pp interleaved)",
    "schedule": "a pipeline schedule needs pp of 2 or more ('none' without); interleaved a "
                "vp whose chunks split the layers evenly",
    "vp": "interleaved 1F1B needs the layers (with the embedding and the loss, or not) to "
          "split into pp x vp equal chunks (vp of 2 or more); DualPipeV runs vp=2; 1 without "
          "interleaving",
    "ac": "activation checkpointing: none, selective or full",
    "zero": "ZeRO-1 or ZeRO-3",
    "ac_layers": "ac_layers counts the layers of one pipeline rank",
}


def check_fixed(job: Job, fixed: dict[str, object], what: str = "layout") -> None:
    """Raise `SpecError` naming the first pinned field (in `_RULES`' order) that no layout of
    `job` allows given the fields before it, with its rule and the values that would do
    (`what`: the option's name, `layout.tp`)."""
    given: dict[str, object] = {}

    def allowed(pins: dict[str, object]) -> list[Layout]:
        return list(layouts(job.model, job.cluster, job.gpus, job.seq_len, job.global_batch,
                            fixed=pins))

    for name in _RULES:
        if name not in fixed:
            continue
        if allowed(given | {name: fixed[name]}):
            given[name] = fixed[name]
            continue
        before = allowed(given)  # what the fields before it allow
        context = ", ".join(f"{k}={v}" for k, v in given.items())
        where = (f"{job.model.name} on {job.gpus} GPUs, {job.global_batch} sequences of "
                 f"{job.seq_len} tokens" + (f", {context}" if context else ""))
        if name == "ac_layers":
            most = max((stage_layers(job.model, lay) for lay in before), default=0)
            raise SpecError(f"{what}.ac_layers", f"{fixed[name]} is more than the {most} layers "
                            f"of a pipeline rank ({where})",
                            f"write ac_layers between 0 and {most} (0: all)")
        values = sorted({getattr(lay, name) for lay in before})
        fix = (f"choose {name} among {values}" if values else
               "change the fields before it" if given else "change the GPUs or the batch")
        raise SpecError(f"{what}.{name}", f"{name}={fixed[name]} does not fit {where}: "
                        f"{_RULES[name]}", fix)


def one_layout(job: Job, fixed: dict[str, object], what: str = "layout") -> Layout:
    """The one layout `fixed` names (its overlap aside): the fields it does not pin take
    `Layout`'s defaults (tp, cp, pp 1, no AC, ZeRO-1, ...; with pp > 1 and no schedule, 1F1B,
    or interleaved where vp is given), dp and micro_batches what the GPUs and the global batch
    leave; else `SpecError` naming what is impossible or missing."""
    rest = {k: v for k, v in fixed.items() if k != "overlap"}
    pp = rest.get("pp", 1)
    if isinstance(pp, int) and pp > 1 and "schedule" not in rest:  # Megatron-LM's default
        rest["schedule"] = "interleaved" if rest.get("vp", 1) != 1 else "1F1B"
    default = Layout()
    derived = {"dp", "micro_batches", "overlap"}  # from the GPUs and the global batch
    found = [lay for lay in layouts(job.model, job.cluster, job.gpus, job.seq_len,
                                    job.global_batch, fixed=rest)
             if all(getattr(lay, f.name) == getattr(default, f.name)
                    for f in dataclasses.fields(Layout) if f.name not in {*rest, *derived})]
    if len(found) != 1:
        if not found:
            check_fixed(job, rest, what)
        open_fields = sorted({f.name for f in dataclasses.fields(Layout)} - set(fixed))
        raise SpecError(what, f"one layout is needed; {len(found)} match "
                        f"{rest or 'no fields'}", "pin " + ", ".join(open_fields)
                        if found else "pin a layout plait can run on these GPUs and batch")
    return found[0]


def measured_layout(job: Job, fixed: dict[str, object]) -> tuple[Layout, Overlap]:
    """The one layout and overlap `fixed` names (a measured run's, `one_layout`)."""
    overlap = fixed.get("overlap")
    if overlap is None:
        raise SpecError("layout", "a measured step needs the overlap it ran",
                        f"add overlap={'|'.join(OVERLAP_KINDS)} to --layout")
    lay = one_layout(job, fixed)
    if not can_overlap(lay, cast(Overlap, overlap)):
        raise SpecError("layout.overlap", f"{lay.label()} cannot run {overlap}",
                        COEXEC_NEEDS)
    chosen = cast(Overlap, overlap)
    return dataclasses.replace(lay, overlap=chosen), chosen


def predict_given(job: Job, lay: Layout, overlap: object = None) -> Prediction:
    """The prediction of layout `lay` (`--compare`, `one_layout`): under `overlap` if given,
    else under the fastest that fits, as the search predicts a layout entering its ranking."""
    if overlap is not None and not can_overlap(lay, cast(Overlap, overlap)):
        raise SpecError("compare.overlap", f"{lay.label()} cannot run {overlap}",
                        COEXEC_NEEDS)
    pinned = None if overlap is None else (cast(Overlap, overlap),)
    return _planned(job, _fitting(job, lay, pinned=pinned), pinned)
