"""What runs: engines, executors, strands, ranks. Needs torch >= 2.11 (`MIN_TORCH`): an older
torch is refused here, on import, in one line, rather than failing somewhere inside a step."""

import re

import torch

from plait.errors import UnsupportedTorch

MIN_TORCH = (2, 11)  # the oldest torch plait is tested on (CI runs both ends: README)


def version_of(text: str) -> tuple[int, int]:
    major, minor = (int(x) for x in re.findall(r"\d+", text)[:2])
    return major, minor


if version_of(torch.__version__) < MIN_TORCH:
    _least = ".".join(map(str, MIN_TORCH))
    raise UnsupportedTorch("torch", f"plait needs torch >= {_least}, found {torch.__version__}",
                           f"pip install 'torch>={_least}'")
