/* The read path of a table row whose size is known: answered from the byte cache (cache.c)
 * in C, without the GIL, when its block's files are there; else where its bytes lie
 * (located.c); else filled by the control plane. On a miss of a block's files that located.c
 * could not answer, `fill(shard, row, offset, size)` asks the control plane: it answers the
 * block's files, (first row, offsets, bytes) of a run of consecutive rows, which are kept
 * (KIND_FILES), or only this read's bytes (its own policy), which are not. Everything fill
 * answers is checked (rows, offsets, lengths against the table's sizes) before it is kept.
 * Workers missing the same block wait for the one filling it (the cache's single flight).
 */
#include "engine.h"

#include <errno.h>
#include <stdlib.h>
#include <string.h>

/* fill's answer as a block's files (checked against `row`): its bytes to keep, or NULL if it lies. */
static char *take_files(PyObject *r, CachedBlock *b, uint64_t row, size_t *length)
{
    Py_buffer offsets, data;
    uint64_t first, count, i;
    const uint64_t *o;
    char *kept = NULL;
    int ok = 0;
    if (!PyTuple_Check(r) || PyTuple_GET_SIZE(r) != 3 || bridge_u64(PyTuple_GET_ITEM(r, 0), &first) != 0)
        return NULL;
    if (PyObject_GetBuffer(PyTuple_GET_ITEM(r, 1), &offsets, PyBUF_C_CONTIGUOUS) != 0) {
        PyErr_Clear();
        return NULL;
    }
    if (PyObject_GetBuffer(PyTuple_GET_ITEM(r, 2), &data, PyBUF_C_CONTIGUOUS) != 0) {
        PyErr_Clear();
        PyBuffer_Release(&offsets);
        return NULL;
    }
    count = offsets.len / 8;
    o = offsets.buf;
    if (offsets.len % 8 == 0 && count >= 2 && row >= first && row - first < count - 1
        && o[0] == 0 && o[count - 1] == (uint64_t)data.len) {
        ok = 1;
        for (i = 1; i < count && ok; i++)
            ok = o[i - 1] <= o[i];
    }
    if (ok) {
        b->offsets = malloc((size_t)offsets.len);
        kept = malloc(data.len ? (size_t)data.len : 1);
        if (b->offsets == NULL || kept == NULL) {
            free(kept);
            kept = NULL;
        }
    }
    if (kept != NULL) {
        memcpy(b->offsets, o, (size_t)offsets.len);
        if (data.len > 0)  /* an empty buffer's may be NULL */
            memcpy(kept, data.buf, (size_t)data.len);
        b->first_row = first;
        b->count = count - 1;
        *length = (size_t)data.len;
    }
    PyBuffer_Release(&offsets);
    PyBuffer_Release(&data);
    return kept;
}

/* Row `row` (of `fsize` bytes) from a ready entry of its block's files, which is released:
 * 1 answered, 0 not this row's (the control plane answers), -EIO if the entry lies. */
static int serve_files(Session *s, fuse_req_t req, CachedBlock *b, uint64_t row, uint64_t fsize, size_t size,
                       off_t off)
{
    uint64_t i, start, end;
    if (row < b->first_row || row - b->first_row >= b->count) {
        cache_release(&s->cache, b);  /* filled for other rows: not this one's block after all */
        return 0;
    }
    i = row - b->first_row;
    start = b->offsets[i];
    end = b->offsets[i + 1];
    if (end - start != fsize) {
        cache_release(&s->cache, b);
        COUNT(s, ST_READ, 1);
        return -EIO;
    }
    {
        uint64_t from = (uint64_t)off < fsize ? (uint64_t)off : fsize;
        uint64_t n = fsize - from < size ? fsize - from : size;
        fuse_reply_buf(req, b->data + start + from, (size_t)n);  /* ours until readers drops */
    }
    cache_release(&s->cache, b);
    COUNT(s, ST_READ, 1);
    return 1;
}

/* A miss of the block's files: fill them from the control plane (b is ours, FILLING). */
static int fill(Session *s, fuse_req_t req, CachedBlock *b, uint64_t shard, uint64_t row, uint64_t fsize,
                size_t size, off_t off)
{
    PyGILState_STATE gil = bridge_enter();
    PyObject *r = bridge_call(s, CB_FILL, Py_BuildValue("(nKLn)", (Py_ssize_t)shard, (unsigned long long)row,
                                                        (long long)off, (Py_ssize_t)size));
    char *kept = NULL;
    size_t length = 0;
    int err = 0;
    if (r != NULL && PyBytes_Check(r)) {
        /* Only this read's bytes: answered now, nothing kept. */
        size_t got = 0;
        char *buf = bridge_read_reply(r, size, &got, &err, "fill");
        if (buf != NULL) {
            Py_DECREF(r);
            bridge_leave(gil);
            cache_abandon(&s->cache, b);
            COUNT(s, ST_READ, 0);
            fuse_reply_buf(req, buf, got);
            return 1;
        }
    } else if (r == NULL || (kept = take_files(r, b, row, &length)) == NULL) {
        err = r != NULL && PyLong_Check(r) ? bridge_errno(r, "fill") : EIO;
    }
    Py_XDECREF(r);
    bridge_leave(gil);
    if (err) {
        cache_abandon(&s->cache, b);
        COUNT(s, ST_READ, 0);
        return -err;
    }
    cache_complete(&s->cache, b, kept, length);
    return serve_files(s, req, b, row, fsize, size, off);
}

int readpath_read(Session *s, fuse_req_t req, fuse_ino_t ino, size_t size, off_t off)
{
    int64_t row;
    uint64_t shard, block = 0, fsize = 0;
    ShardTable *t = table_of(s, ino, &row);
    CachedBlock *b;
    int known = 0, mine, answered;
    if (t == NULL || row < 0 || off < 0)
        return 0;
    shard = ino_shard(ino);
    pthread_rwlock_rdlock(&t->lock);
    if (t->attached && (uint64_t)row < t->n) {
        uint8_t kind;
        uint32_t row_block;
        if (column_read(&t->kind, (uint64_t)row, &kind, WIDTH_KIND) == 0 && kind == KIND_FILE
            && column_read(&t->size, (uint64_t)row * WIDTH_SIZE, &fsize, WIDTH_SIZE) == 0
            && column_read(&t->block, (uint64_t)row * WIDTH_BLOCK, &row_block, WIDTH_BLOCK) == 0) {
            block = row_block;
            known = fsize != UNKNOWN_SIZE;
        }
    }
    pthread_rwlock_unlock(&t->lock);
    if (!known)
        return 0;
    /* The block's files, if they are here; else where the file's bytes lie (located.c). */
    b = cache_wait(&s->cache, shard, KIND_FILES, block);
    if (b != NULL)
        return serve_files(s, req, b, (uint64_t)row, fsize, size, off);
    pthread_rwlock_rdlock(&t->lock);  /* held while the locator's buffers are read */
    answered = t->located == NULL ? 0
               : located_read(s, t->located, engine_request(req), shard, (uint64_t)row, block, fsize, size, off);
    pthread_rwlock_unlock(&t->lock);
    if (answered != 0)
        return answered;
    b = cache_acquire(&s->cache, shard, KIND_FILES, block, &mine);
    if (b == NULL)
        return -ENOMEM;
    if (!mine)
        return serve_files(s, req, b, (uint64_t)row, fsize, size, off);
    return fill(s, req, b, shard, (uint64_t)row, fsize, size, off);
}
