"""`plait analyze` on real traces of other people's jobs (`../shared/data/traces/`), checked
against a reference computation written here, independently of `plait.analyze`: its own
reading of the JSON, its own choice of communication kernels by name, its own step assignment
and a sweep over interval boundaries (not interval merging)."""

import gzip
import json
import os
import re
from pathlib import Path

import pytest

from plait.analyze.analysis import analyze


def _traces() -> Path | None:
    here = Path(__file__).resolve().parent.parent
    for p in (os.environ.get("PLAIT_REAL_TRACES"), here.parent / "shared/data/traces",
              here / "shared/data/traces"):
        if p and Path(p, "hta").is_dir():
            return Path(p)
    return None


ROOT = _traces()
pytestmark = pytest.mark.skipif(ROOT is None, reason="the real traces (../shared/data/traces, "
                                "or $PLAIT_REAL_TRACES) are not beside this checkout")
NCCL = re.compile(r"^nccl\w*Kernel_")
DEEPEP = re.compile(r"dpsk::ep::internode::(dispatch|combine|notify_dispatch|cached_notify)<")


def _sweep(comm, comp):
    """(communication busy, communication with no compute) by a sweep over boundaries."""
    marks = sorted([(s, 0, 1) for s, e in comm] + [(e, 0, -1) for s, e in comm]
                   + [(s, 1, 1) for s, e in comp] + [(e, 1, -1) for s, e in comp])
    busy = alone = 0.0
    depth = [0, 0]
    last = None
    for t, which, d in marks:
        if last is not None and depth[0] > 0:
            busy += t - last
            if depth[1] == 0:
                alone += t - last
        depth[which] += d
        last = t
    return busy, alone


def reference(path: Path, is_comm, steps):
    """Per step: communication and exposed time of the GPU kernels whose launch lies in one of
    `steps` (ProfilerStep numbers); a kernel with no launch event goes by its own start."""
    doc = json.loads(gzip.decompress(path.read_bytes()))
    ev = [e for e in doc["traceEvents"] if e.get("ph") == "X"]
    ranges = {int(e["name"].split("#")[1]): (e["ts"], e["ts"] + e["dur"]) for e in ev
              if e["name"].startswith("ProfilerStep#") and e.get("cat") != "gpu_user_annotation"}
    launch = {e["args"]["correlation"]: e["ts"] for e in ev
              if e.get("cat") in ("cuda_runtime", "cuda_driver")}

    def step_of(k):
        t = launch.get(k["args"].get("correlation"), k["ts"])
        return next((n for n, (a, b) in ranges.items() if a <= t < b), None)

    comm, comp = [], []
    for k in ev:
        if k.get("cat") not in ("kernel", "gpu_memcpy") or step_of(k) not in steps:
            continue
        span = (k["ts"], k["ts"] + k["dur"])
        if k["cat"] == "gpu_memcpy":
            if "PtoP" in k["name"]:
                comm.append(span)
        elif is_comm(k["name"]):
            comm.append(span)
        else:
            comp.append(span)
    busy, alone = _sweep(comm, comp)
    return busy / len(steps), alone / len(steps)


CASES = [  # (trace, its communication kernels, the window plait must choose)
    ("deepseek-v3-train-dualpipe-chunk-pair.json.gz", DEEPEP.search, {1}),
    ("hta/hta-nccl-parser-config/nccl_data.json.gz", NCCL.match, {4, 5}),
    ("hta/hta-df-index-resolver/df_index_resolver.json.gz", NCCL.match, {2, 3, 4, 5}),
    ("hta/hta-trace-filter-2rank/sampled_rank-0.json.gz", NCCL.match, {551, 552}),
    ("hta/hta-trace-filter-2rank/sampled_rank-1.json.gz", NCCL.match, {551, 552}),
]


@pytest.mark.parametrize(("name", "is_comm", "window"), CASES, ids=[c[0].split("/")[-1]
                                                                     for c in CASES])
def test_real_trace_matches_the_reference(name, is_comm, window):
    assert ROOT is not None
    path = ROOT / name
    a = analyze([path], None)
    assert set(a.window.steps) == window, a.window.note
    (d,) = a.traces[0].exposure
    comm, exposed = reference(path, is_comm, window)
    assert d.comm_us / d.steps == pytest.approx(comm, rel=1e-9)
    assert d.exposed_us / d.steps == pytest.approx(exposed, rel=1e-9)


def test_deepseek_expert_parallel_communication_is_almost_all_hidden():
    assert ROOT is not None
    a = analyze([ROOT / CASES[0][0]], None)
    t = a.traces[0]
    (rule,) = t.rules
    assert rule.rule == "expert parallel" and rule.kernels == 32
    (d,) = t.exposure
    assert d.overlapped_us / d.comm_us > 0.9  # DualPipe hides it under the other chunk


def test_an_outlier_last_step_is_left_out_of_real_traces():
    assert ROOT is not None
    a = analyze([ROOT / CASES[2][0]], None)  # the last step holds twice the communication
    assert a.window.dropped_last == 6 and "2.0x the median" in a.window.note


def test_two_of_128_ranks_give_waiting_as_a_lower_bound():
    assert ROOT is not None
    a = analyze([ROOT / CASES[3][0], ROOT / CASES[4][0]], None)
    assert a.waiting_is_bound and any("2 of 128 ranks" in n for n in a.notes)
    for t in a.traces:
        (d,) = t.exposure
        assert d.waiting_us is not None and 0 <= d.waiting_us <= d.exposed_us
    same = analyze([ROOT / CASES[3][0], ROOT / CASES[3][0]], None)  # one trace twice
    assert len(same.traces) == 1 and same.traces[0].exposure[0].waiting_us is None
