"""Lavender Data shardsets: reading, and mounting as a source.

A Lavender dataset is a folder of shardsets, each a folder of
``shard.NNNNN.csv`` or ``shard.NNNNN.parquet`` files holding some of the
dataset's columns, and all holding the uid column (found from their headers: the
column every shardset has; or ``-o uid_column=COLUMN``). As lavender-data joins, a
sample is a row of the main shardset with the rows of the same uid in the shards of
the same index of the others: ``join=inner`` (the default) leaves out a sample some
shardset lacks, ``join=left`` shows it without that shardset's columns. Binary
columns get an extension from their first cell (:mod:`.cells`: ``.png``...;
lavender-data's serialized ndarrays become ``.npy``).

Mounted, shard index ``N`` is the folder ``shard.NNNNN`` and each sample the
files ``<uid>.<column>...`` of the naming contract (a csv cell is a string:
``<uid>.caption.txt``; parquet cells keep their types: an int is
``<uid>.score.cls``, a float ``.json``, binary data keeps the column's name
as it is; a parquet null is no file). The uid column is the key, not a file,
except for a sample whose uid cannot be a file name (it has a ``.`` or a
``/``...): that sample gets an index key, and its uid a file, so it is not lost.

Order: the rows of the main shardset, in file order. A block is a run of :data:`BLOCK_ROWS` samples or fewer (for parquet, a row
group of the main shardset, or an even part of one, when they are of one
size); :meth:`LavenderShard.prepare` reads the uid column of every file of the
shard once and keeps where each sample's row is in every shardset (and, for
csv, where every row starts), so a block reads only its rows: for parquet its
row groups (a few kept in memory for the neighbouring blocks), for csv the
byte range of its rows.

A column name found in more than one shardset (other than the uid column;
letter case aside, as WebDataset folds it) would give two files one name:
each of them is named ``<shardset>.<column>`` instead (``<uid>.captions_v2.
caption.txt``), in every shardset that has it, and the renaming is logged
once.

Broken rules are named one line each (file and row, or uid) and left out,
while the rest serves: a shard file without the uid column is left out of its
shard; a row without a uid, or repeating one already in its file, is left
out; a uid in shard N of one shardset and in shard M of another cannot be
joined, and stays unjoined in each (``Source.problems`` finds every case for
``verify``; a mount logs those it meets in the shards it opens). A pass keeps the
first 1,000 lines of one file (the rest counted in one line). A shard file of more
than 4,096 columns (each a file of every sample), of more than 4,194,304 rows, or
whose uids take more than 256 MiB, is left out; a block whose rows take more than
``max_block_bytes`` fails, before they are read.

The package's rooms: ``cells.py`` (what a binary cell holds), ``files.py`` (one shard file:
the pass over its uid column, reads of chosen rows), ``csvrows.py`` and ``parquetrows.py`` (how
a csv or parquet file is read), ``bounds.py`` (a parquet row group's decoded bytes bounded
before pyarrow decodes it), ``join.py`` (the join by uid), ``shard.py`` (:class:`LavenderShard`:
its saved state, blocks), ``source.py`` (:class:`LavenderSource`, the dataset folder),
``errors.py`` (:class:`LavenderError`) and ``write.py`` (:func:`write_csv_shard`, for producers).
"""

from __future__ import annotations

from atlasfs.formats.lavender.files import CSV_GAP_ROWS, SHARD_FILE, LavenderError, RowGroupCache, ScanResult, ShardFile
from atlasfs.formats.lavender.shard import BLOCK_ROWS, STATE_VERSION, LavenderShard
from atlasfs.formats.lavender.source import (
           DEFAULT_UID,
           LOGGED_PROBLEMS,
           ROW_GROUP_CACHE_BYTES,
           LavenderSource,
           looks_like,
           open_source,
)
from atlasfs.formats.lavender.write import write_csv_shard

__all__ = ["BLOCK_ROWS", "CSV_GAP_ROWS", "DEFAULT_UID", "LOGGED_PROBLEMS", "ROW_GROUP_CACHE_BYTES", "SHARD_FILE",
           "STATE_VERSION", "LavenderError", "LavenderShard", "LavenderSource", "RowGroupCache", "ScanResult",
           "ShardFile", "looks_like", "open_source", "write_csv_shard"]
