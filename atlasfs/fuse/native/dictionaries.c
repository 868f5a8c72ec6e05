/* zstd dictionaries shared by the shards that have the same one.
 *
 * A dataset's shards share its zstd_dict.bin: one decompression dictionary serves every shard
 * located.c reads, however many are attached, instead of one a shard. Entries are counted, and
 * freed with their last shard.
 *
 * The dictionary's bytes are kept once: a dictionary made from a bytes object (what the control
 * plane gives: the file, read whole in Python) refers to that object's bytes, held until the
 * dictionary is freed (ZSTD_createDDict_byReference: its entropy tables are its own, its
 * content is not copied); from any other buffer, from one copy. Before, the bytes were copied
 * twice beside Python's (ours to compare, and ZSTD_createDDict's own): a dictionary of 1 GiB
 * took the daemon to about 3 GiB.
 */
#define ZSTD_STATIC_LINKING_ONLY  /* ZSTD_createDDict_byReference (in libzstd since 1.0) */
#include "engine.h"

#include <stdlib.h>
#include <string.h>

struct SharedDict {
    SharedDict *next;
    const char *bytes;  /* its content (the held object's, or `copy`), to compare */
    size_t len;
    PyObject *held;     /* the bytes object `bytes` is in, owned; NULL: `copy` */
    char *copy;
    uint64_t refs;
    ZSTD_DDict *ddict;  /* refers to `bytes`: freed first */
};

static SharedDict *dicts;
static pthread_mutex_t dicts_lock = PTHREAD_MUTEX_INITIALIZER;

static void dict_free(SharedDict *d)
{
    ZSTD_freeDDict(d->ddict);  /* before the bytes it refers to */
    Py_XDECREF(d->held);
    free(d->copy);
    free(d);
}

SharedDict *dictionary_take(PyObject *obj)
{
    SharedDict *d, *made = NULL;
    Py_buffer view;
    const char *bytes;
    size_t len;
    if (PyObject_GetBuffer(obj, &view, PyBUF_C_CONTIGUOUS) != 0)
        return NULL;
    if (view.len <= 0) {
        PyBuffer_Release(&view);
        PyErr_SetString(PyExc_ValueError, "locate: an empty zstd dictionary");
        return NULL;
    }
    bytes = view.buf;
    len = (size_t)view.len;
    /* The GIL is held throughout: the list's lock is only ever taken with it, or briefly. */
    pthread_mutex_lock(&dicts_lock);
    for (d = dicts; d != NULL; d = d->next)
        if (d->len == len && memcmp(d->bytes, bytes, len) == 0)
            break;
    if (d != NULL)
        d->refs++;
    pthread_mutex_unlock(&dicts_lock);
    if (d != NULL) {
        PyBuffer_Release(&view);
        return d;
    }
    if ((made = calloc(1, sizeof *made)) == NULL)
        goto no_memory;
    if (PyBytes_CheckExact(obj)) {  /* immutable: referred to, held */
        Py_INCREF(obj);
        made->held = obj;
        made->bytes = PyBytes_AS_STRING(obj);
    } else {  /* a buffer that may change: one copy */
        if ((made->copy = malloc(len)) == NULL)
            goto no_memory;
        memcpy(made->copy, bytes, len);
        made->bytes = made->copy;
    }
    PyBuffer_Release(&view);
    made->len = len;
    made->refs = 1;
    made->ddict = ZSTD_createDDict_byReference(made->bytes, len);
    if (made->ddict == NULL) {
        dict_free(made);
        PyErr_SetString(PyExc_ValueError, "locate: not a zstd dictionary");
        return NULL;
    }
    pthread_mutex_lock(&dicts_lock);
    made->next = dicts;
    dicts = made;
    pthread_mutex_unlock(&dicts_lock);
    return made;
no_memory:
    PyBuffer_Release(&view);
    if (made != NULL)
        dict_free(made);
    PyErr_NoMemory();
    return NULL;
}

const ZSTD_DDict *dictionary_ddict(const SharedDict *d)
{
    return d != NULL ? d->ddict : NULL;
}

void dictionary_drop(SharedDict *d)
{
    SharedDict **at;
    if (d == NULL)
        return;
    pthread_mutex_lock(&dicts_lock);
    if (--d->refs == 0) {
        for (at = &dicts; *at != NULL && *at != d; at = &(*at)->next)
            ;
        if (*at == d)
            *at = d->next;
    } else {
        d = NULL;
    }
    pthread_mutex_unlock(&dicts_lock);
    if (d != NULL)
        dict_free(d);
}

size_t dictionary_count(void)
{
    size_t n = 0;
    const SharedDict *d;
    pthread_mutex_lock(&dicts_lock);
    for (d = dicts; d != NULL; d = d->next)
        n++;
    pthread_mutex_unlock(&dicts_lock);
    return n;
}
