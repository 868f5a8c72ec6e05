/* Calls from libfuse's worker threads into Python.
 *
 * libfuse's workers are not Python threads: PyGILState_Ensure would create a Python
 * thread state for every call and destroy it after (a fifth of the CPU of a small-file
 * tar in the ctypes adapter). Each worker keeps one for its life instead: its first call
 * takes one extra reference, dropped by a thread-specific destructor when libfuse ends
 * the worker. The GIL is held only inside a call into Python.
 */
#include "engine.h"

#include <errno.h>
#include <stdlib.h>
#include <string.h>

typedef struct {
    PyThreadState *kept;  /* this thread's state, kept between calls (NULL: none kept) */
    char *scratch;     /* a buffer for replies built here (a read's bytes, a listing) */
    size_t scratch_size;
    PyObject *held;    /* a reply written from its own bytes: let go of at the next call (bridge_hold) */
} Worker;

static pthread_key_t worker_key;
static pthread_once_t worker_once = PTHREAD_ONCE_INIT;
static int worker_key_ok;

static void worker_end(void *p)
{
    Worker *w = p;
    if (w->kept != NULL && Py_IsInitialized()) {
        /* glibc has already cleared Python's own thread-specific slot (keys without a
         * destructor are cleared too, in key order): the kept state is dropped by hand. */
        PyEval_RestoreThread(w->kept);
        Py_CLEAR(w->held);
        PyThreadState_Clear(w->kept);
        PyThreadState_DeleteCurrent();  /* releases the GIL */
    }
    free(w->scratch);
    free(w);
}

static void worker_key_create(void)
{
    worker_key_ok = pthread_key_create(&worker_key, worker_end) == 0;
}

int bridge_setup(void)
{
    pthread_once(&worker_once, worker_key_create);
    return worker_key_ok ? 0 : -1;
}

static Worker *worker(void)
{
    Worker *w = pthread_getspecific(worker_key);
    if (w == NULL) {
        w = calloc(1, sizeof *w);
        if (w == NULL || pthread_setspecific(worker_key, w) != 0) {
            free(w);
            return NULL;
        }
    }
    return w;
}

PyGILState_STATE bridge_enter(void)
{
    Worker *w = worker();
    if (w != NULL && !w->kept && PyGILState_GetThisThreadState() == NULL) {
        /* A libfuse worker's first call: make its thread state and keep it (see above).
         * The main thread (single-threaded loop) has its own state and keeps nothing. */
        PyGILState_Ensure();
        w->kept = PyEval_SaveThread();
    }
    {
        PyGILState_STATE state = PyGILState_Ensure();
        if (w != NULL)
            Py_CLEAR(w->held);  /* its reply was written since: this thread wrote it */
        return state;
    }
}

void bridge_hold(PyObject *r)
{
    Worker *w = worker();
    if (w == NULL) {  /* cannot be kept: the caller holds the GIL, so nothing may read it after */
        Py_DECREF(r);
        return;
    }
    Py_XSETREF(w->held, r);
}

void bridge_leave(PyGILState_STATE state)
{
    PyGILState_Release(state);
}

void *bridge_scratch(size_t size)
{
    Worker *w = worker();
    if (w == NULL)
        return NULL;
    if (w->scratch_size < size) {
        char *bigger = realloc(w->scratch, size);
        if (bigger == NULL)
            return NULL;
        w->scratch = bigger;
        w->scratch_size = size;
    }
    return w->scratch;
}

PyObject *bridge_call(Session *s, int which, PyObject *args)
{
    PyObject *result = NULL;
    if (args != NULL) {
        result = PyObject_Call(s->callbacks[which], args, NULL);
        Py_DECREF(args);
    }
    if (result == NULL) {
        /* The control plane logs its own errors and returns an errno: an exception here
         * is a bug in it. Say so where Python says it, answer EIO. */
        PyErr_WriteUnraisable(s->callbacks[which]);
    }
    return result;
}

int bridge_errno(PyObject *result, const char *what)
{
    if (result == NULL)
        return EIO;
    if (PyLong_Check(result)) {
        long code = PyLong_AsLong(result);
        if (code < 0 && code > -4096)
            return (int)-code;
        PyErr_Clear();
    }
    PyErr_Format(PyExc_TypeError, "atlasfs engine: %s returned an unexpected value", what);
    PyErr_WriteUnraisable(result);
    return EIO;
}

char *bridge_read_reply(PyObject *r, size_t size, size_t *got, int *err, const char *what)
{
    char *buf;
    Py_ssize_t i, n;
    size_t total = 0;
    if (r != NULL && PyList_Check(r)) {
        /* Pieces (the tar view's headers and files): gathered here, where a join in Python
         * would make a buffer of the whole reply first (mapped afresh, every page faulted). */
        n = PyList_GET_SIZE(r);
        for (i = 0; i < n; i++) {
            PyObject *piece = PyList_GET_ITEM(r, i);
            if (!PyBytes_Check(piece) || (size_t)PyBytes_GET_SIZE(piece) > size - total) {
                *err = bridge_errno(r, what);  /* a list of anything but bytes, or too long */
                return NULL;
            }
            total += (size_t)PyBytes_GET_SIZE(piece);
        }
        buf = bridge_scratch(total ? total : 1);
        if (buf == NULL) {
            *err = ENOMEM;
            return NULL;
        }
        for (i = 0, total = 0; i < n; i++) {
            PyObject *piece = PyList_GET_ITEM(r, i);
            memcpy(buf + total, PyBytes_AS_STRING(piece), (size_t)PyBytes_GET_SIZE(piece));
            total += (size_t)PyBytes_GET_SIZE(piece);
        }
        *got = total;
        return buf;
    }
    if (r == NULL || !PyBytes_Check(r) || (size_t)PyBytes_GET_SIZE(r) > size) {
        *err = bridge_errno(r, what);
        return NULL;
    }
    *got = (size_t)PyBytes_GET_SIZE(r);
    buf = bridge_scratch(*got ? *got : 1);
    if (buf == NULL)
        *err = ENOMEM;
    else
        memcpy(buf, PyBytes_AS_STRING(r), *got);
    return buf;
}

int bridge_u64(PyObject *value, uint64_t *out)
{
    unsigned long long v;
    if (!PyLong_Check(value))
        return -1;
    v = PyLong_AsUnsignedLongLong(value);
    if (v == (unsigned long long)-1 && PyErr_Occurred()) {
        PyErr_Clear();
        return -1;
    }
    *out = v;
    return 0;
}

void bridge_forget(Session *s, fuse_ino_t ino, uint64_t nlookup)
{
    PyObject *pairs = Py_BuildValue("([(KK)])", (unsigned long long)ino, (unsigned long long)nlookup);
    Py_XDECREF(bridge_call(s, CB_FORGET, pairs));
}
