/* What the engine gives a format's reader in C, and nothing more: no FUSE, no Session or
 * ShardTable layout. A reader (atlasfs/formats/atlas/native/located.c, Atlas's located reads)
 * reads a table's columns, the byte cache and files on disk, adds to the session's counts, and
 * answers a read request through engine_reply. The engine's side is reader.c (and tables.c,
 * diskblocks.c, dictionaries.c for theirs).
 */
#ifndef ATLASFS_READER_H
#define ATLASFS_READER_H

#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include <stdint.h>
#include <sys/stat.h>
#include <sys/types.h>
#include <sys/uio.h>
#include <zstd.h>

#include "cache.h"
#include "layout.h"

/* The engine's, opaque here. */
typedef struct Session Session;
typedef struct ShardTable ShardTable;
/* A read request to answer (libfuse's), once, by engine_reply. */
typedef struct ReaderRequest ReaderRequest;
/* A format reader's state of one shard (its own type), which the shard's table holds. */
typedef struct Located Located;

/* One column of an attached table: a Python buffer (a view of the mapped table file, or an
 * array in memory), or `len` bytes at `at` of the table's file, read with pread (`fd`, the
 * shard's: file mode, which holds no memory and outlives the control plane's map). */
typedef struct {
    Py_buffer view;  /* buffer mode when view.obj != NULL */
    int fd;
    uint64_t at, len;
} Column;

/* `path` opened for reading (O_NONBLOCK: a FIFO or a device in its place never blocks the
 * open; O_CLOEXEC; `flags` more), the GIL released meanwhile, and fstat'd into `st`: its
 * descriptor if it is a regular file, else -1 with a Python error (OSError, or ValueError: not
 * a regular file). GIL held. */
int open_regular(const char *path, int flags, struct stat *st);
/* `size` bytes at `at` of file `fd` into `buf` (pread, again after EINTR or a short read): 0,
 * or -1 (an error, or the file ends first). */
int read_full(int fd, char *buf, size_t size, uint64_t at);
/* Bytes [from, from + size) of column `c` into `out`: 0, or -1 (out of the column, or the file
 * cut short: a table that lies). */
int column_read(const Column *c, uint64_t from, void *out, size_t size);
/* `c` from `obj`: a buffer, or with a table file (`fd` >= 0, `file_size` bytes) an
 * (offset, length) tuple within it. 0, or -1 with a Python error. */
int column_from(PyObject *obj, Column *c, int fd, uint64_t file_size, const char *what);
void column_release(Column *c);

/* Requests answered in C and by the control plane, per kind (Session.stats()); "located": reads
 * answered in C where the file's bytes lie, and those a reader left to the control plane;
 * "stored": of those, whole-file reads of the run alone as stored, and those that took the
 * block's payload instead. */
enum { ST_LOOKUP, ST_GETATTR, ST_READDIR, ST_READ, ST_LOCATED, ST_STORED, ST_COUNT };

/* What a located reader counts in the session (Session.frames()): the stored bytes of the
 * shards whose located reads are attached (what a shuffled pass needs the cache to hold);
 * blocks' frames decompressed whole (kept for the pass), up to a read file's end, and reads
 * that waited for another worker's; what payloads made so far cost the cache, and the stored
 * bytes they were made of (what a pass over the attached shards would need kept). Atomics. */
typedef struct {
    uint64_t located_stored;
    uint64_t frames_whole, frames_partial, frames_waited;
    uint64_t kept_made, kept_stored;
} ReaderCounters;

/* reader.c */
ByteCache *engine_cache(Session *s);
ReaderCounters *engine_counters(Session *s);
/* One request of `kind` (ST_...) answered in C (by_c 1) or left to the control plane (0). */
void engine_count(Session *s, int kind, int by_c);
/* The reply to `req`: the `count` pieces at `iov` in order (none: an empty reply). */
void engine_reply(ReaderRequest *req, const struct iovec *iov, int count);

/* tables.c, for attaching a reader's state to a shard's table (GIL held). */
/* Shard position `shard`'s table, or NULL with a Python IndexError. */
ShardTable *engine_table(Session *s, Py_ssize_t shard, const char *what);
/* Whether a table is attached: 1 and its rows and generation (attached or detached this many
 * times), or 0. */
int engine_table_rows(const ShardTable *t, uint64_t *rows, uint64_t *generation);
/* column_from on the table's file (its columns may be ranges of it). */
int engine_table_column(const ShardTable *t, PyObject *obj, Column *c, const char *what);
/* `l` made the table's located reads if it is still the table of `generation` with `rows`
 * rows (its lock taken with the GIL released): 0 and *old the state it replaced (the caller
 * frees it), or -1 (attached again or detached meanwhile: its columns may be ranges of a file
 * closed since). */
int engine_table_locate(ShardTable *t, Located *l, uint64_t generation, uint64_t rows, Located **old);

/* diskblocks.c: decoded blocks kept in files of a folder (Session.decoded_cache). */
/* The key of a shard's blocks' files: its data.bin (resolved path) and the signatures of
 * data.bin and index.npy, under the dataset's identity; 0: no decoded cache. GIL held. */
uint64_t diskblocks_key(const Session *s, const char *data_path, const int64_t sig[4]);
/* Whether block `block`'s file is there, written whole. */
int diskblocks_has(Session *s, uint64_t key, uint64_t block);
/* Whether a block of `size` decoded bytes would be kept. */
int diskblocks_fits(const Session *s, uint64_t size);
/* Bytes [at, at + size) of block `block`'s file into `out`: 0, 1 not there, -1 there but not
 * readable as written (dropped). The caller checks the bytes (CRC-32), diskblocks_drop if not. */
int diskblocks_read(Session *s, uint64_t key, uint64_t block, uint64_t at, size_t size, char *out);
void diskblocks_drop(Session *s, uint64_t key, uint64_t block);
/* The `size` decoded bytes of block `block` kept in a file (once; within the bound). */
void diskblocks_write(Session *s, uint64_t key, uint64_t block, const char *data, size_t size);

/* dictionaries.c: one decompression dictionary for every shard made with the same bytes. */
typedef struct SharedDict SharedDict;
/* The dictionary of the bytes of `obj` (a buffer), counted once more (made at its first take:
 * it refers to `obj` itself when it is a bytes object, held until its last drop, else to one
 * copy), or NULL with a Python error: not a dictionary, or no memory. GIL held. */
SharedDict *dictionary_take(PyObject *obj);
const ZSTD_DDict *dictionary_ddict(const SharedDict *d);
/* Counted once less; freed with its last (NULL: nothing). GIL held (its bytes may be a Python
 * object); no reader may use it any more (the shard's lock was taken since it was replaced). */
void dictionary_drop(SharedDict *d);
/* Dictionaries held now (Python: _native.dictionaries()). */
size_t dictionary_count(void);

#endif
