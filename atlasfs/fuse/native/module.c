/* atlasfs.fuse._native: the Session type, a libfuse 3 low-level session whose requests the
 * control plane (atlasfs/fuse/engine.py) answers. Its life cycle is Python's: mount(), then
 * loop() in the main thread (the GIL released; returns once unmounted or exit() was called
 * from another thread), then unmount().
 */
#include "engine.h"

#include <errno.h>
#include <string.h>

static const char *const CALLBACK_NAMES[CB_COUNT] = {
    "lookup", "getattr", "readdir", "read", "forget", "statfs", "init", "fill",
};

static int Session_init(Session *self, PyObject *args, PyObject *kwds)
{
    static char *kwlist[] = {
        "bridge", "entry_timeout", "attr_timeout", "negative_timeout", "uid", "gid", "file_mode",
        "dir_mode", "max_read", "max_readahead", "max_background", "congestion_threshold",
        "async_read", "threads", "max_threads", "max_idle_threads", "shards", "cache_bytes", NULL,
    };
    PyObject *bridge;
    unsigned int uid = 0, gid = 0, file_mode = 0100444, dir_mode = 040555;
    Py_ssize_t shards = 0, cache_bytes = 64 << 20;
    int i;
    self->threads = 1;
    self->max_threads = 10;
    self->max_idle_threads = 10;
    if (!PyArg_ParseTupleAndKeywords(args, kwds, "O|$dddIIIIIIIIipIInn", kwlist, &bridge,
                                     &self->entry_timeout, &self->attr_timeout, &self->negative_timeout,
                                     &uid, &gid, &file_mode, &dir_mode, &self->max_read,
                                     &self->max_readahead, &self->max_background,
                                     &self->congestion_threshold, &self->async_read, &self->threads,
                                     &self->max_threads, &self->max_idle_threads, &shards, &cache_bytes))
        return -1;
    if (self->se != NULL) {
        PyErr_SetString(PyExc_RuntimeError, "the session is set up already");
        return -1;
    }
    if (self->tables != NULL || cache_bytes < 0) {
        PyErr_SetString(PyExc_ValueError, "the session is set up already, or cache_bytes < 0");
        return -1;
    }
    if (tables_init(self, shards) != 0 || cache_init(&self->cache, (size_t)cache_bytes) != 0)
        return -1;
    if (bridge_setup() != 0) {
        PyErr_SetString(PyExc_RuntimeError, "no thread-specific key for libfuse's workers");
        return -1;
    }
    for (i = 0; i < CB_COUNT; i++) {
        PyObject *method = PyObject_GetAttrString(bridge, CALLBACK_NAMES[i]);
        if (method == NULL)
            return -1;
        Py_XSETREF(self->callbacks[i], method);
    }
    Py_INCREF(bridge);
    Py_XSETREF(self->bridge, bridge);
    self->uid = uid;
    self->gid = gid;
    self->file_mode = file_mode;
    self->dir_mode = dir_mode;
    if (self->max_threads < 1)
        self->max_threads = 1;
    return 0;
}

static PyObject *Session_mount(Session *self, PyObject *args)
{
    PyObject *argv_list, *mountpoint_bytes;
    struct fuse_args fargs = FUSE_ARGS_INIT(0, NULL);
    Py_ssize_t i, n;
    int ok = 0;
    if (!PyArg_ParseTuple(args, "O!O&", &PyList_Type, &argv_list, PyUnicode_FSConverter, &mountpoint_bytes))
        return NULL;
    if (self->se != NULL) {
        Py_DECREF(mountpoint_bytes);
        PyErr_SetString(PyExc_RuntimeError, "mounted already");
        return NULL;
    }
    n = PyList_GET_SIZE(argv_list);
    for (i = 0; i < n; i++) {
        PyObject *item = PyList_GET_ITEM(argv_list, i);
        const char *arg = PyUnicode_Check(item) ? PyUnicode_AsUTF8(item) : NULL;
        if (arg == NULL || fuse_opt_add_arg(&fargs, arg) != 0) {
            if (!PyErr_Occurred())
                PyErr_SetString(PyExc_TypeError, "libfuse arguments are strings");
            goto done;
        }
    }
    /* libfuse prints why it refuses (unknown option, mount failed) on stderr. */
    self->se = fuse_session_new(&fargs, &atlasfs_ops, sizeof atlasfs_ops, self);
    if (self->se == NULL) {
        PyErr_SetString(PyExc_RuntimeError, "libfuse refused the session's options");
        goto done;
    }
    if (fuse_session_mount(self->se, PyBytes_AS_STRING(mountpoint_bytes)) != 0) {
        fuse_session_destroy(self->se);
        self->se = NULL;
        PyErr_SetString(PyExc_RuntimeError, "libfuse could not mount");
        goto done;
    }
    self->mounted = 1;
    ok = 1;
done:
    fuse_opt_free_args(&fargs);
    Py_DECREF(mountpoint_bytes);
    return ok ? Py_NewRef(Py_None) : NULL;
}

static PyObject *Session_loop(Session *self, PyObject *unused)
{
    int err;
    struct fuse_session *se = self->se;
    (void)unused;
    if (se == NULL) {
        PyErr_SetString(PyExc_RuntimeError, "not mounted");
        return NULL;
    }
    Py_BEGIN_ALLOW_THREADS
    if (self->threads) {
        struct fuse_loop_config *config = fuse_loop_cfg_create();
        if (config == NULL) {
            err = -ENOMEM;
        } else {
            fuse_loop_cfg_set_max_threads(config, self->max_threads);
            fuse_loop_cfg_set_idle_threads(config, self->max_idle_threads);
            err = fuse_session_loop_mt(se, config);
            fuse_loop_cfg_destroy(config);
        }
    } else {
        err = fuse_session_loop(se);
    }
    Py_END_ALLOW_THREADS
    return PyLong_FromLong(err);
}

static PyObject *Session_exit(Session *self, PyObject *unused)
{
    (void)unused;
    if (self->se != NULL)
        fuse_session_exit(self->se);  /* sets a flag: safe from any thread */
    Py_RETURN_NONE;
}

static void session_close(Session *self)
{
    if (self->se == NULL)
        return;
    if (self->mounted)
        fuse_session_unmount(self->se);
    self->mounted = 0;
    fuse_session_destroy(self->se);
    self->se = NULL;
}

static PyObject *Session_unmount(Session *self, PyObject *unused)
{
    (void)unused;
    Py_BEGIN_ALLOW_THREADS
    session_close(self);
    Py_END_ALLOW_THREADS
    Py_RETURN_NONE;
}

static PyObject *Session_fd(Session *self, PyObject *unused)
{
    (void)unused;
    return PyLong_FromLong(self->se != NULL ? fuse_session_fd(self->se) : -1);
}

static PyObject *Session_stats(Session *self, PyObject *unused)
{
    static const char *const kinds[ST_COUNT] = {"lookup", "getattr", "readdir", "read", "located", "stored"};
    PyObject *out = PyDict_New();
    int k;
    (void)unused;
    for (k = 0; out != NULL && k < ST_COUNT; k++) {
        PyObject *pair = Py_BuildValue("{sKsK}", "c",
                                       (unsigned long long)__atomic_load_n(&self->stats[k][1], __ATOMIC_RELAXED),
                                       "python",
                                       (unsigned long long)__atomic_load_n(&self->stats[k][0], __ATOMIC_RELAXED));
        if (pair == NULL || PyDict_SetItemString(out, kinds[k], pair) != 0)
            Py_CLEAR(out);
        Py_XDECREF(pair);
    }
    return out;
}

static PyObject *Session_frames(Session *self, PyObject *unused)
{
    (void)unused;
    return Py_BuildValue("{sKsKsKsKsK}", "whole", (unsigned long long)__atomic_load_n(&self->counters.frames_whole, __ATOMIC_RELAXED),
                         "partial", (unsigned long long)__atomic_load_n(&self->counters.frames_partial, __ATOMIC_RELAXED),
                         "waited", (unsigned long long)__atomic_load_n(&self->counters.frames_waited, __ATOMIC_RELAXED),
                         "kept", (unsigned long long)__atomic_load_n(&self->counters.kept_made, __ATOMIC_RELAXED),
                         "of", (unsigned long long)__atomic_load_n(&self->counters.kept_stored, __ATOMIC_RELAXED));
}

/* Session.lend(n): up to n bytes of the byte cache's bound lent to the tree's block cache
 * (cache_lend: never waits; the GIL stays held, as no worker holding the cache's lock waits
 * for it). */
static PyObject *Session_lend(Session *self, PyObject *arg)
{
    Py_ssize_t n = PyNumber_AsSsize_t(arg, PyExc_OverflowError);
    if (n == -1 && PyErr_Occurred())
        return NULL;
    if (n < 0 || self->cache.buckets == NULL) {
        PyErr_SetString(PyExc_ValueError, "lend: a byte count >= 0, on a session set up");
        return NULL;
    }
    return PyLong_FromSize_t(cache_lend(&self->cache, (size_t)n));
}

static PyObject *Session_repay(Session *self, PyObject *arg)
{
    Py_ssize_t n = PyNumber_AsSsize_t(arg, PyExc_OverflowError);
    if (n == -1 && PyErr_Occurred())
        return NULL;
    if (n < 0 || self->cache.buckets == NULL) {
        PyErr_SetString(PyExc_ValueError, "repay: a byte count >= 0, on a session set up");
        return NULL;
    }
    cache_repay(&self->cache, (size_t)n);
    Py_RETURN_NONE;
}

static PyObject *Session_cache(Session *self, PyObject *unused)
{
    ByteCache *c = &self->cache;
    unsigned long long v[6];
    (void)unused;
    if (c->buckets == NULL)
        Py_RETURN_NONE;
    pthread_mutex_lock(&c->lock);  /* one consistent view; the lock is held briefly by anyone */
    v[0] = c->total;
    v[1] = c->lent;
    v[2] = c->bytes;
    v[3] = c->flight;
    v[4] = c->peak;
    v[5] = c->pool_bytes;
    pthread_mutex_unlock(&c->lock);
    return Py_BuildValue("{sKsKsKsKsKsK}", "bound", v[0], "lent", v[1], "bytes", v[2], "flight", v[3], "peak", v[4],
                         "pool", v[5]);
}

static void Session_dealloc(Session *self)
{
    int i;
    session_close(self);
    tables_free(self);
    diskblocks_free(self);
    if (self->cache.buckets != NULL)
        cache_free(&self->cache);
    for (i = 0; i < CB_COUNT; i++)
        Py_CLEAR(self->callbacks[i]);
    Py_CLEAR(self->bridge);
    Py_TYPE(self)->tp_free((PyObject *)self);
}

static PyMethodDef Session_methods[] = {
    {"mount", (PyCFunction)Session_mount, METH_VARARGS,
     "mount(args, mountpoint): a new libfuse session (args: argv with -o options), mounted."},
    {"loop", (PyCFunction)Session_loop, METH_NOARGS,
     "Serve requests until unmounted or exit(); the GIL is released. Returns libfuse's status."},
    {"exit", (PyCFunction)Session_exit, METH_NOARGS, "Ask the loop to end (from any thread)."},
    {"unmount", (PyCFunction)Session_unmount, METH_NOARGS, "Unmount and end the session (idempotent)."},
    {"attach", (PyCFunction)(void (*)(void))tables_attach, METH_VARARGS | METH_KEYWORDS,
     "attach(shard, mtime, names, offsets, kind, size, by_path, block, file=None): a flat shard table's columns "
     "(buffers, or with file=(path, (dev, ino, size, mtime_ns)) (offset, length) ranges of the table's file), "
     "answered in C from then on. Called with keywords."},
    {"detach", (PyCFunction)tables_detach, METH_VARARGS, "detach(shard): let go of its columns."},
    {"locate", (PyCFunction)(void (*)(void))located_attach, METH_VARARGS | METH_KEYWORDS,
     "locate(shard, offset, length, check, prefix, prefix_ends, prefixes, inline, kept, kept_ends, data_path, index_path, "
     "signatures=(data_size, data_mtime_ns, index_size, index_mtime_ns), starts, compressed, dictionary, "
     "max_block_bytes): the attached table's locators and where its blocks lie, for reads of its files in C "
     "(located.c). Called with keywords."},
    {"stats", (PyCFunction)Session_stats, METH_NOARGS,
     "Requests answered so far, per kind: {'lookup': {'c': n, 'python': n}, ...}."},
    {"frames", (PyCFunction)Session_frames, METH_NOARGS,
     "Blocks' zstd frames decompressed in C so far: {'whole': n (kept for the pass), 'partial': n (up to a "
     "file's end), 'waited': n (reads that waited for another worker's), 'kept': bytes the whole ones cost the "
     "cache, 'of': their stored bytes}."},
    {"decoded_cache", (PyCFunction)diskblocks_configure, METH_VARARGS,
     "decoded_cache(path, bound, identity): keep blocks decompressed whole in files of the folder `path` (this "
     "user's, writable by no one else), at most `bound` bytes, named under the dataset's `identity` (diskblocks.c)."},
    {"decoded", (PyCFunction)diskblocks_stats, METH_NOARGS,
     "The decoded cache's counts ({'hits': n, 'misses': n, 'written': n, 'write_failed': n, 'bad': n, 'evicted': n, "
     "'found': n, 'ignored': n, 'bytes': n, 'bound': n}), or None when it is off."},
    {"lend", (PyCFunction)Session_lend, METH_O,
     "lend(n): up to n bytes of the byte cache's bound lent to the tree's block cache (entries no one reads "
     "evicted to make room; never waits): the bytes granted, maybe fewer. Given back by repay(n)."},
    {"repay", (PyCFunction)Session_repay, METH_O, "repay(n): n bytes lent by lend() given back."},
    {"cache", (PyCFunction)Session_cache, METH_NOARGS,
     "The byte cache now: {'bound': the mount's whole bound, 'lent': what the tree's block cache holds of it, "
     "'bytes': entries, 'flight': payloads being made, 'peak': the most bytes + flight + lent ever held, "
     "'pool': free buffers kept}, or None before set-up."},
    {"fd", (PyCFunction)Session_fd, METH_NOARGS, "The session's /dev/fuse descriptor, -1 when closed."},
    {NULL, NULL, 0, NULL},
};

static PyTypeObject SessionType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "atlasfs.fuse._native.Session",
    .tp_doc = "Session(bridge, **settings): a libfuse 3 low-level session answered by bridge's methods.",
    .tp_basicsize = sizeof(Session),
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_new = PyType_GenericNew,
    .tp_init = (initproc)Session_init,
    .tp_dealloc = (destructor)Session_dealloc,
    .tp_methods = Session_methods,
};

static PyObject *native_dictionaries(PyObject *module, PyObject *unused)
{
    (void)module;
    (void)unused;
    return PyLong_FromSize_t(dictionary_count());
}

static PyMethodDef native_functions[] = {
    {"dictionaries", native_dictionaries, METH_NOARGS,
     "zstd dictionaries held for located reads, one for every shard made with the same bytes."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef native_module = {
    PyModuleDef_HEAD_INIT, "atlasfs.fuse._native",
    "atlasfs's native data plane on libfuse 3's low-level API (docs/native.md).", -1, native_functions,
};

PyMODINIT_FUNC PyInit__native(void)
{
    PyObject *m;
    if (PyType_Ready(&SessionType) < 0)
        return NULL;
    m = PyModule_Create(&native_module);
    if (m == NULL)
        return NULL;
    if (PyModule_AddObjectRef(m, "Session", (PyObject *)&SessionType) < 0
        || PyModule_AddIntConstant(m, "FUSE_ROOT_ID", FUSE_ROOT_ID) < 0
        || PyModule_AddIntConstant(m, "LIBFUSE_VERSION", fuse_version()) < 0
        /* a read's reply may be a list of bytes, gathered in order (bridge_read_reply) */
        || PyModule_AddIntConstant(m, "READ_PARTS", 1) < 0) {
        Py_DECREF(m);
        return NULL;
    }
    return m;
}
