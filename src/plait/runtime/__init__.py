"""What runs: engines, executors, strands, ranks. Needs torch >= 2.11 (`MIN_TORCH`): an older
torch is refused here, on import, in one line, rather than failing somewhere inside a step."""

import re

import torch

MIN_TORCH = (2, 11)  # the oldest torch plait is tested on (CI runs both ends: README)


def version_of(text: str) -> tuple[int, int]:
    major, minor = (int(x) for x in re.findall(r"\d+", text)[:2])
    return major, minor


if version_of(torch.__version__) < MIN_TORCH:
    raise ImportError(f"plait needs torch >= {'.'.join(map(str, MIN_TORCH))}, found "
                      f"{torch.__version__}: pip install 'torch>={'.'.join(map(str, MIN_TORCH))}'")
