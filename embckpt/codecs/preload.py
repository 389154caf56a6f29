"""Readies the codecs in a process that others are forked from: importing this module loads
every kernel a save or restore calls, so a process forked afterwards starts with them. The
launcher's fork server imports it (``examples/launcher.py``, ``PRELOAD``).

A rank otherwise pays for these itself, every launch: loading the codecs' numba kernels from
their disk cache (about 0.4 s, most of it the adaptive range search) and importing
scikit-learn for the k-means codec (about 1 s, with SciPy). A multi-rank job pays it once per
rank; the test suite, which launches ranks hundreds of times, paid it hundreds of times.

Nothing here may leave a thread behind that a fork would lose: ``torch.set_num_threads(1)``
first, so the kernels' small torch operations never start torch's OpenMP pool (a forked child
of a process with a live OpenMP pool can hang in its first parallel region). The ranks run one
thread each anyway (the launcher's ``_worker``). k-means is imported, not run: fitting starts
scikit-learn's OpenMP threads.
"""

from __future__ import annotations

from embckpt.codecs import precompile

precompile.load_kernels()  # one torch thread first, then the kernels
try:
    import sklearn.cluster  # noqa: F401  (the kmeans extra; without it kmeans never runs)
except ImportError:
    pass
