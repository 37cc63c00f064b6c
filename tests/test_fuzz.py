"""A fuzz harness: generated malformed inputs through the commands that read files. Every
outcome must be a result (exit 0) or one clear line (exit 2): a traceback, a hang or an
uncaught exception is a failure."""

from __future__ import annotations

import json
from pathlib import Path

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from typer.testing import CliRunner

from plait.cli.main import app

runner = CliRunner()
JSONISH = st.recursive(
    st.none() | st.booleans() | st.integers(-10**6, 10**6) | st.text(max_size=8)
    | st.floats(allow_nan=True, allow_infinity=True),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=6), inner,
                                                               max_size=3),
    max_leaves=8)
FIELDS = ("ph", "ts", "dur", "name", "cat", "pid", "tid", "args")
ARG_KEYS = ("Collective name", "Group size", "In msg nelems", "Out msg nelems", "dtype",
            "External id", "stream", "Input Dims", "Input type", "bytes")


def _event(draw_value: dict[str, object]) -> dict[str, object]:
    return draw_value


events = st.lists(st.fixed_dictionaries(
    {}, optional={
        "ph": st.sampled_from(["X", "i", "M"]) | JSONISH,
        "ts": st.integers(0, 10**6) | JSONISH, "dur": st.integers(0, 10**4) | JSONISH,
        "name": st.sampled_from(["ncclDevKernel_AllGather_RING", "sm90_gemm", "aten::mm",
                                 "c10d::allgather_", "ProfilerStep#1"]) | JSONISH,
        "cat": st.sampled_from(["kernel", "cpu_op", "gpu_memcpy", "user_annotation"]) | JSONISH,
        "pid": st.integers(0, 3) | JSONISH, "tid": st.integers(0, 3) | JSONISH,
        "args": st.dictionaries(st.sampled_from(ARG_KEYS), JSONISH, max_size=4) | JSONISH,
    }), max_size=12)


def _outcome(res: object) -> None:
    out = getattr(res, "output", "")
    code = getattr(res, "exit_code", None)
    exc = getattr(res, "exception", None)
    assert code in (0, 2), f"exit {code}: {exc!r}\n{out[-800:]}"
    assert "Traceback" not in out
    if code == 2:  # plait's one line, or the CLI parser's usage error naming the option
        assert "error:" in out or ("Usage:" in out and "Invalid value" in out), out[-800:]


@settings(max_examples=30, deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(evs=events, wrap=st.booleans())
def test_analyze_answers_or_names_the_problem(tmp_path_factory, evs, wrap):
    path = Path(tmp_path_factory.mktemp("fuzz")) / "trace.json"
    path.write_text(json.dumps({"traceEvents": evs} if wrap else evs, allow_nan=True))
    _outcome(runner.invoke(app, ["analyze", str(path), "-H", "none"]))


BROKEN = [b"", b"{", b"\xff\xfe not utf-8", b"[" * 100_000, b'{"traceEvents": 3}',
          b'{"traceEvents": [1, "x", null]}']


def test_analyze_broken_files(tmp_path):
    import gzip

    for i, raw in enumerate(BROKEN):
        p = tmp_path / f"t{i}.json"
        p.write_bytes(raw)
        _outcome(runner.invoke(app, ["analyze", str(p)]))
    gz = tmp_path / "cut.json.gz"
    gz.write_bytes(gzip.compress(b'{"traceEvents": []}' * 100)[:-10])  # truncated
    _outcome(runner.invoke(app, ["analyze", str(gz)]))


@settings(max_examples=30, deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(doc=st.dictionaries(st.sampled_from(
    ["model_type", "num_hidden_layers", "hidden_size", "num_attention_heads",
     "intermediate_size", "vocab_size", "num_key_value_heads", "head_dim", "num_local_experts",
     "num_experts_per_tok", "hidden_act", "layers", "hidden", "heads"]), JSONISH, max_size=9))
def test_explore_model_files_answer_or_name_the_problem(tmp_path_factory, doc):
    path = Path(tmp_path_factory.mktemp("fuzz")) / "config.json"
    path.write_text(json.dumps(doc, allow_nan=True))
    _outcome(runner.invoke(app, ["explore", "--fast", "-m", str(path), "--json", "-"]))


@settings(max_examples=30, deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(section=st.sampled_from(["params", "gpu", "topology"]),
       body=st.dictionaries(st.sampled_from(
           ["launch_overhead_s", "comm_compute_units", "gemm_measured", "link_bytes_per_s",
            "hbm_fraction", "compute_units", "peak_flops", "kind", "dma", "latency_s"]),
           JSONISH, max_size=3))
def test_explore_calibrations_answer_or_name_the_problem(tmp_path_factory, section, body):
    path = Path(tmp_path_factory.mktemp("fuzz")) / "cal.json"
    path.write_text(json.dumps({"plait_calibration": 1, section: body}, allow_nan=True))
    _outcome(runner.invoke(app, ["explore", "--fast", "--calibration", str(path),
                                 "--json", "-"]))


NUMBER = st.integers(-3, 70) | st.sampled_from(["x", "1.5", "", "1e9", "-0", "inf"])
LAYOUT = ("--tp", "--cp", "--pp", "--dp", "--virtual-stages", "--micro-batch",
          "--micro-batches", "--seq-len", "--nodes")


def _options(draw_pairs: list[tuple[str, object]]) -> list[str]:
    return [x for name, value in draw_pairs for x in (name, str(value))]


@settings(max_examples=25, deadline=None)
@given(opts=st.lists(st.tuples(st.sampled_from(LAYOUT), NUMBER), max_size=4),
       sp=st.booleans())
def test_explore_layouts_answer_or_name_the_problem(opts, sp):
    args = ["explore", "--fast", "-m", "llama3-8b", "--json", "-", *_options(opts)]
    _outcome(runner.invoke(app, [*args, "--sp" if sp else "--no-sp"]))


@settings(max_examples=10, deadline=None)
@given(opts=st.lists(st.tuples(st.sampled_from(LAYOUT), NUMBER), max_size=3))
def test_coexec_plan_layouts_answer_or_name_the_problem(opts):
    args = ["coexec", "plan", "-m", "llama3-8b", "--seq-len", "2048", "--json", "-"]
    _outcome(runner.invoke(app, [*args, *_options(opts)]))


@settings(max_examples=25, deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(steps=st.none() | st.text(max_size=6) | st.sampled_from(["1:2", "all", ":", "3:", "9"]),
       pattern=st.none() | st.text(max_size=6) | st.sampled_from(["(", "[a-", "nccl", ".*"]),
       last=st.sampled_from([None, "--drop-last", "--keep-last"]))
def test_analyze_options_answer_or_name_the_problem(tmp_path_factory, steps, pattern, last):
    path = Path(tmp_path_factory.mktemp("fuzz")) / "trace.json"
    evs = [{"ph": "X", "cat": "user_annotation", "name": f"ProfilerStep#{i}", "pid": 1,
            "tid": 1, "ts": 100 * i, "dur": 100} for i in range(1, 4)]
    evs += [{"ph": "X", "cat": "kernel", "name": n, "pid": 0, "tid": 7, "ts": 100 * i + 10,
             "dur": 30} for i in range(1, 4) for n in ("ncclDevKernel_AllReduce", "gemm")]
    path.write_text(json.dumps({"traceEvents": evs}))
    args = ["analyze", str(path), "-H", "none"]
    if steps is not None:
        args += ["--steps", steps]
    if pattern is not None:
        args += ["--comm-kernel", pattern]
    if last is not None:
        args.append(last)
    _outcome(runner.invoke(app, args))


@given(name=st.text(max_size=8) | st.sampled_from(["h100", "mi300x", "cpu"]))
@settings(max_examples=15, deadline=None)
def test_presets_show_answers_or_names_the_problem(name):
    _outcome(runner.invoke(app, ["presets", "--show", name]))
