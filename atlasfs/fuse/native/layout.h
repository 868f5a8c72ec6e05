/* The file table's layout and its rows' node ids, as the engine reads them: stated once here
 * for C. Python's twin is atlasfs/tree/table/layout.py (the table's builders and readers);
 * tests/unit/tree/test_table_layout.py reads this header and fails if any constant here is not
 * Python's, or is defined anywhere else among the C sources.
 *
 * tables.c reads the entry columns, readpath.c a row's kind, size and block, and Atlas's
 * located.c (atlasfs/formats/atlas/native) the locator columns. Every column is untrusted (a stored table may be another user's): readers
 * check each row against the column's length before reading it.
 */
#ifndef ATLASFS_LAYOUT_H
#define ATLASFS_LAYOUT_H

#include <stdint.h>

/* -- the entry columns */

/* An entry's kind (its `kind` column): a file, a folder, or the file standing for a block
 * that could not be decoded (`<index key>.unreadable`). */
#define KIND_FILE 0
#define KIND_DIR 1
#define KIND_UNREADABLE 2
/* A file's size (its `size` column) before its bytes have been encoded. */
#define UNKNOWN_SIZE UINT64_MAX

/* Bytes a row of each column takes (little-endian; layout.py's ENTRY_SECTIONS dtypes).
 * `offsets` holds one more than the rows: where each path starts in the names, then where
 * the last ends. */
#define WIDTH_OFFSETS 8
#define WIDTH_KIND 1
#define WIDTH_SIZE 8
#define WIDTH_BLOCK 4
#define WIDTH_POS 4
#define WIDTH_FILE 2
#define WIDTH_BY_PATH 4
#define WIDTH_HASHES 8
#define WIDTH_HASH_ROWS 4
/* C reads them into integers of these widths. */
_Static_assert(WIDTH_OFFSETS == sizeof(uint64_t) && WIDTH_KIND == sizeof(uint8_t) && WIDTH_SIZE == sizeof(uint64_t)
               && WIDTH_BLOCK == sizeof(uint32_t) && WIDTH_BY_PATH == sizeof(uint32_t), "entry column widths");

/* -- the locator columns (layout.py's LOCATOR_SECTIONS) */

#define WIDTH_OFFSET 4
#define WIDTH_LENGTH 4
#define WIDTH_CHECK 4
#define WIDTH_PREFIX 2
_Static_assert(WIDTH_OFFSET == sizeof(uint32_t) && WIDTH_LENGTH == sizeof(uint32_t) && WIDTH_CHECK == sizeof(uint32_t)
               && WIDTH_PREFIX == sizeof(uint16_t), "locator column widths");
/* A row's locator offset when it has none. */
#define NO_LOCATOR UINT32_MAX
/* A row's prefix number when its locator is inline (its offset is then in the inline bytes). */
#define INLINE_PREFIX 0xFFFF
/* A row's prefix number when its file is kept (offset and length within the decompressed
 * frame of its block's kept files). */
#define KEPT_PREFIX 0xFFFE
/* Most bytes of an inline file. */
#define INLINE_MAX 255
/* Most bytes of a block's kept files, decompressed (C bounds its decompression by it). */
#define KEPT_BLOCK_MAX (16u << 20)

/* -- node ids (inode numbers) of shard folders and table rows: computed, never stored */

/* The mount's root folder (FUSE_ROOT_ID; engine.h checks they agree). */
#define ROOT_NODE 1
/* Bits of a node id below the shard: shard position s's folder is (s + 1) << ROW_BITS, row i
 * of its table that plus 1 + i. */
#define ROW_BITS 32
/* Node ids from here on are shard folders and table rows; below, the control plane's own. */
#define TABLE_NODES (UINT64_C(1) << ROW_BITS)
/* The row part of a node id (the row plus one; 0 for the shard folder). */
#define ROW_MASK (TABLE_NODES - 1)

/* The node id of shard position `s`'s folder. */
static inline uint64_t shard_ino(uint64_t s)
{
    return (s + 1) << ROW_BITS;
}

/* The node id of row `row` of shard position `s`'s table. */
static inline uint64_t row_ino(uint64_t s, uint64_t row)
{
    return shard_ino(s) + 1 + row;
}

/* The shard position of a node id from TABLE_NODES on (not checked against any shard). */
static inline uint64_t ino_shard(uint64_t ino)
{
    return (ino >> ROW_BITS) - 1;
}

/* The row of a node id from TABLE_NODES on; -1 for the shard folder itself. */
static inline int64_t ino_row(uint64_t ino)
{
    return (int64_t)(ino & ROW_MASK) - 1;
}

#endif
