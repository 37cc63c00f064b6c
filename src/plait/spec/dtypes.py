"""The one table of data types: plait's name, element size, the torch dtype and the names a
Kineto trace records. Importing it does not import torch (planning commands stay light);
`torch_dtype` imports it when a tensor is to be made."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch


@dataclass(frozen=True, slots=True)
class DTypeInfo:
    name: str  # plait's name
    bytes: int
    torch: str  # attribute of the torch module
    kineto: tuple[str, ...]  # names in kernel args and recorded input types (lower case)


DTYPES: dict[str, DTypeInfo] = {d.name: d for d in (
    DTypeInfo("fp64", 8, "float64", ("double", "float64")),
    DTypeInfo("fp32", 4, "float32", ("float", "float32")),
    DTypeInfo("bf16", 2, "bfloat16", ("bfloat16", "c10::bfloat16")),
    DTypeInfo("fp16", 2, "float16", ("half", "float16", "c10::half")),
    DTypeInfo("fp8", 1, "float8_e4m3fn", ("float8_e4m3fn", "c10::float8_e4m3fn",
                                          "float8_e5m2", "c10::float8_e5m2")),
)}
DTYPE_BYTES: dict[str, int] = {d.name: d.bytes for d in DTYPES.values()}
_FROM_KINETO = {k: d.name for d in DTYPES.values() for k in d.kineto}
# element sizes of the other types a trace records for a collective's tensors (indices,
# counts, bytes): plait computes in none of them, but counts their bytes
_OTHER_KINETO_BYTES = {"long": 8, "int64": 8, "int": 4, "int32": 4, "short": 2, "int16": 2,
                       "signed char": 1, "int8": 1, "unsigned char": 1, "uint8": 1,
                       "char": 1, "bool": 1}


def torch_dtype(name: str) -> torch.dtype:
    """The torch dtype of plait's dtype `name` (a key of `DTYPES`)."""
    import torch

    dtype: torch.dtype = getattr(torch, DTYPES[name].torch)
    return dtype


def from_kineto(name: object) -> str | None:
    """plait's name of a dtype as a trace records it (None: unknown or absent)."""
    return _FROM_KINETO.get(str(name).lower()) if name is not None else None


def kineto_bytes(name: object) -> int:
    """Element size of a dtype as a trace records it (0: unknown or absent)."""
    if name is None:
        return 0
    low = str(name).lower()
    plait = _FROM_KINETO.get(low)
    return DTYPE_BYTES[plait] if plait else _OTHER_KINETO_BYTES.get(low, 0)


def code(dtype: torch.dtype) -> int:
    """A small integer naming `dtype`, equal on every rank (for cross-rank signatures)."""
    names = [d.torch for d in DTYPES.values()]
    name = str(dtype).removeprefix("torch.")
    return names.index(name) if name in names else len(names)


def plait_name(dtype: torch.dtype) -> str:
    """plait's name of a torch dtype (its torch name for one plait has no name for)."""
    name = str(dtype).removeprefix("torch.")
    return next((d.name for d in DTYPES.values() if d.torch == name), name)
