"""The rows file: a Parquet file of one block of one table shard, rows sorted by global row id.

What its writer (``rowfile_write.py``) and its reader (``rowfile_read.py``) agree on.

Columns:
- ``row``: the int64 global row id, the only column with statistics, so a reader selects a row
  range from row-group statistics alone;
- the codec's columns (``payload`` and any per-row parameters);
- ``state.<name>`` for each row-wise optimizer state: its values, or under a lossy state codec
  ``state.<name>.<column>``, the state encoded as a batch [rows, 1];
- ``elem.<name>.<column>`` for each element-wise optimizer state;
- ``table`` and ``col`` (format 4 on): the block's table identity and first global column,
  dictionary-coded (a few bytes per row group), so a query over many files, packed ones
  included, selects a table's rows by value (``WHERE "table" = ...``).

A *packed* rows file (format 4) holds several small blocks of one rank and one checkpoint
whose columns have the same names and types: each block's rows in row groups of their own,
blocks one after the other. Its header is ``{"blocks": [<block header>, ...]}``, a block's
number in the file being its place there; the manifest lists one entry per block, with the
block's number and its own row groups (``FileIndex.first_group``).

The file's key-value metadata ``embckpt`` (its header) holds the codec configs, what they need
to decode (``codec_meta``, ``elem_meta``, and ``state_meta`` when a row-wise state is encoded)
and the block's place and shape. A header without ``state_meta`` means every row-wise state is
stored as plain values.

Encodings: no dictionary (row payloads never repeat), delta-coded row ids, BYTE_STREAM_SPLIT
float lists (``raw``, ``fp16``, ``bf16`` payloads and element-wise optimizer state), plain for
the rest. No generic compression unless the codec asks for it (pyarrow's defaults measured
about 5x slower to write on such files). Row ids were written with zstd over their delta-coded
bytes until issue 39 (0.95 -> 0.86 bytes per id in a diff of 54k scattered rows of 1M); in a
packed diff it saved 5% of the ids' bytes and cost 0.13 ms of the file's 0.62 ms Parquet read
(one decompression per row group: 8 blocks in a diff of a 7-link chain of
``benchmarks/family.py``'s zipf1.0_dim32), so they are stored uncompressed. A reader accepts any
column with or without compression: Parquet records each column's codec.

Partial reads: the writer records the byte range and CRC32C of every row group and of the
footer (the manifest keeps them, see ``FileIndex``) and combines them into the whole file's
CRC32C, so it reads each byte once. A reader fetches only the footer and the row groups it
needs, checks each against its checksum before parsing, and lets Parquet read nothing else.
"""

from __future__ import annotations

ROW_COLUMN = "row"
TABLE_COLUMN = "table"
COL_COLUMN = "col"
BLOCK_COLUMNS = (ROW_COLUMN, TABLE_COLUMN, COL_COLUMN)  # not the codec's
BLOCKS_KEY = "blocks"  # a packed file's header: each block's own header
STATE_PREFIX = "state."
ELEM_STATE_PREFIX = "elem."
HEADER_KEY = b"embckpt"
MAGIC = b"PAR1"
