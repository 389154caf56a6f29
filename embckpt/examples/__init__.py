"""The reference workload: a Criteo-schema DLRM sharded with TorchRec, and its data.

``synthetic`` generates a skewed click log with a learnable hidden teacher, ``criteo`` reads the
real Criteo click-log TSV files, and ``model`` builds, trains and evaluates the sharded DLRM.
"""
