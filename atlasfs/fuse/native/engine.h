/* The native data plane of atlasfs: shared declarations (docs/native.md).
 *
 * module.c  the Python type `Session` (configuration, mount, loop, exit, unmount)
 * ops.c     libfuse 3's low-level operations
 * bridge.c  calls into Python: thread states, the GIL, replies parsed from Python values
 * tables.c  shard tables attached by the control plane, and the node ids of their rows
 * cache.c   the byte cache: bytes keyed by (shard, kind, block), bounded, filled once (cache.h)
 * readpath.c a read of a table row: from the byte cache, located.c, or the control plane's fill
 * located.c files read where their bytes lie (the table's locators), without Python
 * dictionaries.c zstd dictionaries shared by the shards that have the same one
 * diskblocks.c the decoded-block cache on local disk (--decoded-cache)
 *
 * Everything a Python callback returns is checked here as untrusted: a wrong type or
 * value becomes EIO with one log line, never a crash.
 */
#ifndef ATLASFS_ENGINE_H
#define ATLASFS_ENGINE_H

#define PY_SSIZE_T_CLEAN
#include <Python.h>

#define FUSE_USE_VERSION 312
#include <fuse_lowlevel.h>

#include <pthread.h>
#include <stdint.h>
#include <sys/stat.h>
#include <sys/types.h>
#include <zstd.h>

#include "cache.h"

/* The Python methods the engine calls (the control plane, atlasfs/fuse/engine.py). */
enum {
    CB_LOOKUP, CB_GETATTR, CB_READDIR, CB_READ, CB_FORGET, CB_STATFS, CB_INIT, CB_FILL, CB_COUNT
};

/* Requests answered in C and by the control plane, per kind (Session.stats()); "located": reads
 * answered in C where the file's bytes lie, and those located.c left to the control plane;
 * "stored": of those, whole-file reads of the run alone as stored, and those that took the
 * block's payload instead (located.c). */
enum { ST_LOOKUP, ST_GETATTR, ST_READDIR, ST_READ, ST_LOCATED, ST_STORED, ST_COUNT };
#define COUNT(s, kind, by_c) __atomic_fetch_add(&(s)->stats[kind][by_c], 1, __ATOMIC_RELAXED)

/* The table's kinds, sentinels, column widths and node ids (TABLE_NODES...): layout.h. */
#include "layout.h"
_Static_assert(ROOT_NODE == FUSE_ROOT_ID, "layout.h's root node is FUSE's");

typedef struct Located Located;
typedef struct DiskBlocks DiskBlocks;

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

/* A shard's attached table columns (tables.c). The columns follow the lock, in this order;
 * `located` (located.c) is the shard's located reads, if the control plane gave them; `fd`
 * the table's file in file mode (else -1). */
typedef struct {
    pthread_rwlock_t lock;
    uint64_t generation;  /* attached or detached this many times (under the lock, GIL held) */
    Column names, offsets, kind, size, by_path, block;
    uint64_t n, file_size;
    uint64_t hint;  /* the row a lookup tries first: the one after the last found (tables.c) */
    double mtime;
    int attached, fd;
    Located *located;
} ShardTable;

typedef struct {
    PyObject_HEAD
    struct fuse_session *se;
    int mounted;
    PyObject *callbacks[CB_COUNT];  /* bound methods of the bridge, owned */
    PyObject *bridge;
    /* Replies. */
    double entry_timeout, attr_timeout, negative_timeout;
    uid_t uid;
    gid_t gid;
    mode_t file_mode, dir_mode;
    /* fuse_conn_info fields set in init; 0 leaves libfuse's. */
    unsigned max_read, max_readahead, max_background, congestion_threshold;
    int async_read;  /* -1 sync_read, 1 async_read, 0 as libfuse has it */
    /* The loop. */
    int threads;
    unsigned max_threads, max_idle_threads;
    uint64_t stats[ST_COUNT][2];  /* [kind][0: Python, 1: C] */
    /* Shard tables, one slot per shard position. */
    ShardTable *tables;
    Py_ssize_t ntables;
    ByteCache cache;  /* the byte cache (cache.c) */
    /* Stored bytes of the shards whose located reads are attached (located.c: what a shuffled
     * pass needs the cache to hold), and blocks' frames decompressed: whole (kept for the
     * pass), up to a read file's end, and reads that waited for another worker's. */
    uint64_t located_stored;
    uint64_t frames_whole, frames_partial, frames_waited;
    /* What payloads made so far cost the cache, and the stored bytes they were made of
     * (located.c keep_whole: what a pass over the attached shards would need kept). */
    uint64_t kept_made, kept_stored;
    DiskBlocks *disk;  /* the decoded-block cache on disk (diskblocks.c), NULL: off */
} Session;

/* ops.c */
extern const struct fuse_lowlevel_ops atlasfs_ops;
void fill_attr(const Session *s, struct stat *st, int is_dir, uint64_t size, double mtime, uint64_t ino);

/* tables.c: each answer 1 (answered), 0 (the control plane answers) or a negative errno. */
int tables_init(Session *s, Py_ssize_t shards);
void tables_free(Session *s);
PyObject *tables_attach(Session *self, PyObject *args, PyObject *kwds);
PyObject *tables_detach(Session *self, PyObject *args);
ShardTable *table_of(Session *s, fuse_ino_t ino, int64_t *row);
int tables_lookup(Session *s, fuse_ino_t parent, const char *name, struct fuse_entry_param *e);
int tables_getattr(Session *s, fuse_ino_t ino, struct stat *st);
int tables_readdir(Session *s, fuse_req_t req, fuse_ino_t folder, size_t size, off_t off, int plus,
                   char *buf, size_t *used);

/* bridge.c */
int bridge_setup(void);
PyGILState_STATE bridge_enter(void);
void bridge_leave(PyGILState_STATE state);
PyObject *bridge_call(Session *s, int which, PyObject *args);
int bridge_errno(PyObject *result, const char *what);
int bridge_u64(PyObject *value, uint64_t *out);
void bridge_forget(Session *s, fuse_ino_t ino, uint64_t nlookup);
void *bridge_scratch(size_t size);
/* A read's reply `r` (bytes, or a list of bytes gathered in order; at most `size` in all)
 * copied into the worker's scratch buffer, to be
 * written to the kernel with the GIL released: the copy and *got, or NULL and *err (ENOMEM,
 * or bridge_errno's answer for anything but such bytes). GIL held. */
char *bridge_read_reply(PyObject *r, size_t size, size_t *got, int *err, const char *what);
/* `r` (the reference is handed over) kept until this worker's next call into Python: a reply
 * written from its own bytes with the GIL released. GIL held. */
void bridge_hold(PyObject *r);

/* readpath.c: a read of a table row whose size is known, from the byte cache, else where
 * its bytes lie (located.c), else filled by the control plane: 1 answered, 0 not a row C
 * answers (the control plane does), or a negative errno. */
int readpath_read(Session *s, fuse_req_t req, fuse_ino_t ino, size_t size, off_t off);

/* located.c */
PyObject *located_attach(Session *self, PyObject *args, PyObject *kwds);
void located_free(Located *l);
int located_read(Session *s, ShardTable *t, fuse_req_t req, uint64_t shard, uint64_t row, uint64_t block,
                 uint64_t fsize, size_t size, off_t off);

/* diskblocks.c: decoded blocks kept in files of a folder (Session.decoded_cache). */
PyObject *diskblocks_configure(Session *self, PyObject *args);
PyObject *diskblocks_stats(Session *self, PyObject *unused);
void diskblocks_free(Session *s);
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
