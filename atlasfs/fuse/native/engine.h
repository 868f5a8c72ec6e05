/* The native data plane of atlasfs: shared declarations (docs/native.md).
 *
 * module.c  the Python type `Session` (configuration, mount, loop, exit, unmount)
 * ops.c     libfuse 3's low-level operations
 * bridge.c  calls into Python: thread states, the GIL, replies parsed from Python values
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
#include <sys/types.h>

/* The Python methods the engine calls (the control plane, atlasfs/fuse/engine.py). */
enum {
    CB_LOOKUP, CB_GETATTR, CB_READDIR, CB_READ, CB_FORGET, CB_STATFS, CB_INIT, CB_COUNT
};

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
} Session;

/* ops.c */
extern const struct fuse_lowlevel_ops atlasfs_ops;

/* bridge.c */
int bridge_setup(void);
PyGILState_STATE bridge_enter(void);
void bridge_leave(PyGILState_STATE state);
PyObject *bridge_call(Session *s, int which, PyObject *args);
int bridge_errno(PyObject *result, const char *what);
int bridge_u64(PyObject *value, uint64_t *out);
void bridge_forget(Session *s, fuse_ino_t ino, uint64_t nlookup);
void *bridge_scratch(size_t size);

#endif
