"""Which numba kernels of the codecs a process has compiled or loaded: tests of when they are
readied (the Checkpointer before its first save, the launcher's fork server for its ranks)."""

from __future__ import annotations


def kernel_signatures() -> dict[str, int]:
    """Compiled signatures of every numba kernel of the codecs, by ``module.name``."""
    from embckpt.codecs import (
        adaptive_kernels,
        huffman_kernels,
        kmeans_kernels,
        uniform_kernels,
    )

    out = {}
    for module in (adaptive_kernels, huffman_kernels, kmeans_kernels, uniform_kernels):
        for name, value in vars(module).items():
            if hasattr(value, "signatures") and hasattr(value, "py_func"):
                out[f"{module.__name__}.{name}"] = len(value.signatures)
    return out
