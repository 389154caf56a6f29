"""The rows file: a Parquet file of one block of one table shard, rows sorted by global row id.

What its writer (``rowfile_write.py``) and its reader (``rowfile_read.py``) agree on.

Columns:
- ``row``: the int64 global row id, the only column with statistics, so a reader selects a row
  range from row-group statistics alone;
- the codec's columns (``payload`` and any per-row parameters);
- ``state.<name>`` for each row-wise optimizer state: its values, or under a lossy state codec
  ``state.<name>.<column>``, the state encoded as a batch [rows, 1];
- ``elem.<name>.<column>`` for each element-wise optimizer state.

The file's key-value metadata ``embckpt`` (its header) holds the codec configs, what they need
to decode (``codec_meta``, ``elem_meta``, and ``state_meta`` when a row-wise state is encoded)
and the block's place and shape. A header without ``state_meta`` means every row-wise state is
stored as plain values.

Encodings: no dictionary (row payloads never repeat), delta-coded row ids, BYTE_STREAM_SPLIT
float lists (``raw``, ``fp16``, ``bf16`` payloads and element-wise optimizer state), plain for
the rest. No generic compression unless the codec asks for it (pyarrow's defaults measured
about 5x slower to write on such files), except for the row ids. Those get zstd over their
delta-coded bytes: 0.95 -> 0.86 bytes per id in a diff of 54k scattered rows of 1M (the gaps'
entropy is 0.66), next to nothing in a full, whose ids are consecutive. A reader accepts row
ids with or without compression: Parquet records each column's codec.

Partial reads: the writer records the byte range and CRC32C of every row group and of the
footer (the manifest keeps them, see ``FileIndex``) and combines them into the whole file's
CRC32C, so it reads each byte once. A reader fetches only the footer and the row groups it
needs, checks each against its checksum before parsing, and lets Parquet read nothing else.
"""

from __future__ import annotations

ROW_COLUMN = "row"
STATE_PREFIX = "state."
ELEM_STATE_PREFIX = "elem."
HEADER_KEY = b"embckpt"
MAGIC = b"PAR1"
