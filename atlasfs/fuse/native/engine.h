/* The native data plane of atlasfs: shared declarations (docs/native.md).
 *
 * module.c  the Python type `Session` (configuration, mount, loop, exit, unmount)
 * ops.c     libfuse 3's low-level operations
 * bridge.c  calls into Python: thread states, the GIL, replies parsed from Python values
 * tables.c  shard tables attached by the control plane, and the node ids of their rows
 * cache.c   the byte cache: bytes keyed by (shard, kind, block), bounded, filled once (cache.h)
 * readpath.c a read of a table row: from the byte cache, located.c, or the control plane's fill
 * reader.c  what a format's reader in C may use of the engine (reader.h: no FUSE)
 * atlasfs/formats/atlas/native/located.c Atlas's files read where their bytes lie (the
 *           table's locators), without Python, through reader.h
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
/* What a format's reader in C may use of the engine (columns, files, the byte cache, counts,
 * replies), and Atlas's located reads (atlasfs/formats/atlas/native): they include no FUSE. */
#include "reader.h"
#include "located.h"

/* The Python methods the engine calls (the control plane, atlasfs/fuse/engine.py). */
enum {
    CB_LOOKUP, CB_GETATTR, CB_READDIR, CB_READ, CB_FORGET, CB_STATFS, CB_INIT, CB_FILL, CB_COUNT
};

/* Requests answered in C and by the control plane, per kind (ST_..., reader.h). */
#define COUNT(s, kind, by_c) __atomic_fetch_add(&(s)->stats[kind][by_c], 1, __ATOMIC_RELAXED)

/* The table's kinds, sentinels, column widths and node ids (TABLE_NODES...): layout.h. */
#include "layout.h"
_Static_assert(ROOT_NODE == FUSE_ROOT_ID, "layout.h's root node is FUSE's");

typedef struct DiskBlocks DiskBlocks;

/* A shard's attached table columns (tables.c). The columns follow the lock, in this order;
 * `located` (located.c) is the shard's located reads, if the control plane gave them; `fd`
 * the table's file in file mode (else -1). */
struct ShardTable {
    pthread_rwlock_t lock;
    uint64_t generation;  /* attached or detached this many times (under the lock, GIL held) */
    Column names, offsets, kind, size, by_path, block;
    uint64_t n, file_size;
    uint64_t hint;  /* the row a lookup tries first: the one after the last found (tables.c) */
    double mtime;
    int attached, fd;
    Located *located;
};

struct Session {
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
    ReaderCounters counters;  /* located.c's (reader.h) */
    DiskBlocks *disk;  /* the decoded-block cache on disk (diskblocks.c), NULL: off */
};

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

/* A libfuse request as reader.h's: given to a reader, answered by engine_reply (reader.c). */
static inline ReaderRequest *engine_request(fuse_req_t req)
{
    return (ReaderRequest *)req;
}

/* readpath.c: a read of a table row whose size is known, from the byte cache, else where
 * its bytes lie (located.c), else filled by the control plane: 1 answered, 0 not a row C
 * answers (the control plane does), or a negative errno. */
int readpath_read(Session *s, fuse_req_t req, fuse_ino_t ino, size_t size, off_t off);


/* diskblocks.c: decoded blocks kept in files of a folder (Session.decoded_cache). */
PyObject *diskblocks_configure(Session *self, PyObject *args);
PyObject *diskblocks_stats(Session *self, PyObject *unused);
void diskblocks_free(Session *s);
/* diskblocks_key, _has, _fits, _read, _drop, _write: reader.h. */

/* dictionaries.c: reader.h. */

#endif
