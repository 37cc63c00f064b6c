"""Option groups: options spelled once (name, type, default, help) for every command that takes
them, handed to the command as one value built from them.

    @takes(parallel=PARALLEL, cluster=CLUSTER.defaults(hardware="h100"))
    def plan_command(parallel: ParallelSpec, cluster: ClusterSpec, ...) -> None: ...

The command's `parallel` parameter is replaced, in the signature typer reads, by the group's
options; the command receives `PARALLEL.build(**their values)`, or the group's own values
(`Values`) when the group has no builder. A builder's `SpecError` is the usual one line and
exit status 2. Builders import what they need when they run, so `--help` imports nothing.
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any

import typer

from plait.cli.common import load_cluster, parallel_spec, user_errors, writable

if TYPE_CHECKING:
    from plait.spec.hardware import ClusterSpec
    from plait.spec.layout import ParallelSpec
    from plait.spec.model import ModelSpec


@dataclass(frozen=True)
class Option:
    name: str  # the Python name; the flag is --name with dashes unless `decls` says
    type: Any
    default: Any
    help: str
    decls: tuple[str, ...] = ()
    show_default: bool = True

    def parameter(self, kind: Any = inspect.Parameter.KEYWORD_ONLY) -> inspect.Parameter:
        info = typer.Option(*self.decls, help=self.help, show_default=self.show_default)
        return inspect.Parameter(self.name, kind,
                                 default=self.default,
                                 annotation=Annotated[self.type, info])


class Values(dict[str, Any]):
    """A group's option values by name, also readable as attributes."""

    def __getattr__(self, name: str) -> Any:
        try:
            return self[name]
        except KeyError:
            raise AttributeError(name) from None


@dataclass(frozen=True)
class OptionGroup:
    options: tuple[Option, ...]
    build: Callable[..., Any] | None = None
    checks: tuple[Callable[[Values], None], ...] = field(default=())

    def defaults(self, **values: Any) -> OptionGroup:
        """The same options with other defaults."""
        unknown = set(values) - {o.name for o in self.options}
        assert not unknown, f"no such options: {unknown}"
        return dataclasses.replace(self, options=tuple(
            dataclasses.replace(o, default=values.get(o.name, o.default)) for o in self.options))

    def helps(self, **texts: str) -> OptionGroup:
        """The same options with other help texts (what they mean for this command)."""
        return dataclasses.replace(self, options=tuple(
            dataclasses.replace(o, help=texts.get(o.name, o.help)) for o in self.options))

    def only(self, *names: str) -> OptionGroup:
        """A group of some of these options (the builder gets only those)."""
        return dataclasses.replace(self, options=tuple(o for o in self.options
                                                       if o.name in names))

    def check(self, *checks: Callable[[Values], None]) -> OptionGroup:
        """The same group with checks run on its values before it is built."""
        return dataclasses.replace(self, checks=self.checks + checks)

    def value(self, values: Values) -> Any:
        for check in self.checks:
            check(values)
        return values if self.build is None else self.build(**values)


def takes(**groups: OptionGroup) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    """Replace each named parameter of a command by the options of its group (see the module
    docstring)."""

    def wrap(command: Callable[..., Any]) -> Callable[..., Any]:
        sig = inspect.signature(command)  # annotations as text: a group's may be TYPE_CHECKING's
        params = []  # each group's options where the command names the group
        for p in sig.parameters.values():
            if p.name in groups:
                params += [o.parameter(p.kind) for o in groups[p.name].options]
            else:
                params.append(p.replace(annotation=eval(p.annotation, command.__globals__))
                              if isinstance(p.annotation, str) else p)

        @functools.wraps(command)
        def run(**kwargs: Any) -> Any:
            with user_errors():
                for name, group in groups.items():
                    kwargs[name] = group.value(Values(
                        {o.name: kwargs.pop(o.name) for o in group.options}))
            return command(**kwargs)

        run.__signature__ = sig.replace(parameters=params)  # type: ignore[attr-defined]
        run.__annotations__ = {p.name: p.annotation for p in params}
        del run.__wrapped__  # typer reads the signature above, not the command's
        return run

    return wrap


# ---- the groups -------------------------------------------------------------------------------

def _model(model: str) -> ModelSpec:
    from plait.spec.model import load_model

    return load_model(model)


MODEL = OptionGroup((Option("model", str, "llama3-70b", "Preset name, HF config.json or plait "
                            "model YAML/JSON", ("--model", "-m")),), _model)


def _cluster(hardware: str, calibration: Path | None = None, nodes: int | None = None
             ) -> ClusterSpec:
    return load_cluster(hardware, calibration, nodes)


CLUSTER = OptionGroup((
    Option("hardware", str, "h100", "Preset name or cluster YAML/JSON", ("--hardware", "-H")),
    Option("calibration", Path | None, None, "Calibration file to apply"),
    Option("nodes", int | None, None, "Override the cluster's node count"),
), _cluster)


def _parallel(**fields: Any) -> ParallelSpec:
    return parallel_spec(**fields)


PARALLEL = OptionGroup((
    Option("tp", int, 8, "Tensor-parallel size"),
    Option("sp", bool, True, "Sequence parallelism", ("--sp/--no-sp",)),
    Option("cp", int, 1, "Context-parallel size"),
    Option("ep", int, 1, "Expert-parallel size"),
    Option("pp", int, 1, "Pipeline stages"),
    Option("virtual_stages", int, 1, "Model chunks per pipeline rank: 1 = 1F1B, v > 1 = "
           "interleaved 1F1B"),
    Option("dp", int, 1, "Data-parallel replicas"),
    Option("micro_batch", int, 1, "Sequences per micro-batch"),
    Option("seq_len", int, 8192, "Tokens per sequence"),
    Option("micro_batches", int, 1, "Micro-batches per step"),
    Option("dtype", str, "bf16", "fp32, bf16, fp16 or fp8"),
    Option("capacity_factor", float, 1.0, "MoE: expert rows as a multiple of balanced routing "
           "(>= 1)"),
    Option("regather", bool, True, "Backward re-gathers a column-parallel linear's input for "
           "its weight gradient (Megatron-LM), or keeps the forward's (PyTorch DTensor TP as in "
           "torchtitan, plait's runtime; its baseline is then sequential)",
           ("--regather/--keep-gathered",)),
), _parallel)


def _outputs(**paths: Path | None) -> Values:
    writable(**{("json" if k == "json_out" else k): v for k, v in paths.items()})
    return Values(paths)


OUTPUTS = OptionGroup((
    Option("json_out", Path | None, None, "Write the result as JSON ('-' for stdout)",
           ("--json",)),
    Option("trace", Path | None, None, "Write a Chrome/Perfetto trace (open in ui.perfetto.dev)"),
    Option("plot", Path | None, None, "Write a PNG"),
), _outputs)
