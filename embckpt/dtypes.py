"""Names of tensor dtypes as manifests and file metadata spell them.

Tables, optimizer states and codec parameters are stored with their dtype's name (``float32``,
``float16`` ...) so that a reader without the writer's torch build rebuilds the same dtype.
"""

from __future__ import annotations

import torch

from embckpt.errors import UnknownCodecError

_TORCH_DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32,
    "float16": torch.float16,
    "bfloat16": torch.bfloat16,
    "float64": torch.float64,
}


def dtype_name(dtype: torch.dtype) -> str:
    """The stable name a manifest uses for ``dtype``."""
    return str(dtype).removeprefix("torch.")


def dtype_from_name(name: str) -> torch.dtype:
    """Inverse of :func:`dtype_name` for the dtypes embedding tables use."""
    try:
        return _TORCH_DTYPES[name]
    except KeyError:
        raise UnknownCodecError(f"unsupported row dtype {name!r}") from None
