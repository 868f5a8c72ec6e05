/* The byte cache: the encoded files of a block of a shard whose table is attached, so that
 * reads of its rows are answered in C without the GIL.
 *
 * Keyed by (shard, block), bounded in bytes (least recently used blocks go first, never one
 * a reader is copying from). On a miss one worker asks the control plane, `fill(shard, row,
 * offset, size)`: it answers the block's files, (first row, offsets, bytes) of a run of
 * consecutive rows, which are kept, or only this read's bytes (its own policy: a random
 * read of a block it has not decoded is served from where the file's bytes lie, without
 * decoding the block), which are not. Meanwhile the other workers missing the same block
 * wait for it: a block is decoded once. Everything fill answers is checked (rows, offsets,
 * lengths against the table's sizes) before it is kept.
 */
#include "engine.h"

#include <errno.h>
#include <stdlib.h>
#include <string.h>

enum { FILLING, READY };

struct CachedBlock {
    uint64_t shard, block, first_row, count;
    uint64_t *offsets;  /* count + 1, ascending, the last the data's length */
    char *data;
    size_t bytes;
    int state, readers;
    CachedBlock *next, *prev;  /* the LRU list, most recently used first */
};

int cache_init(Session *s, size_t bound)
{
    s->cache_bound = bound;
    s->cache_bytes = 0;
    s->cache_head = NULL;
    if (pthread_mutex_init(&s->cache_lock, NULL) != 0 || pthread_cond_init(&s->cache_filled, NULL) != 0)
        return -1;
    return 0;
}

static void block_free(CachedBlock *b)
{
    free(b->offsets);
    free(b->data);
    free(b);
}

static void unlink_block(Session *s, CachedBlock *b)
{
    if (b->prev != NULL)
        b->prev->next = b->next;
    else
        s->cache_head = b->next;
    if (b->next != NULL)
        b->next->prev = b->prev;
    b->next = b->prev = NULL;
}

static void push_front(Session *s, CachedBlock *b)
{
    b->prev = NULL;
    b->next = s->cache_head;
    if (s->cache_head != NULL)
        s->cache_head->prev = b;
    s->cache_head = b;
}

void cache_free(Session *s)
{
    while (s->cache_head != NULL) {
        CachedBlock *b = s->cache_head;
        unlink_block(s, b);
        block_free(b);
    }
    pthread_mutex_destroy(&s->cache_lock);
    pthread_cond_destroy(&s->cache_filled);
}

/* A linear search: the cache holds tens to hundreds of blocks (a block's files are tens of
 * KiB to MiBs); a hash table is for when it holds more. Lock held. */
static CachedBlock *find(Session *s, uint64_t shard, uint64_t block)
{
    CachedBlock *b;
    for (b = s->cache_head; b != NULL; b = b->next)
        if (b->shard == shard && b->block == block)
            return b;
    return NULL;
}

/* Evict ready blocks no one reads, least recently used first, to stay within the bound. */
static void shrink(Session *s)
{
    CachedBlock *b = s->cache_head, *last = NULL;
    while (b != NULL) {
        last = b;
        b = b->next;
    }
    while (s->cache_bytes > s->cache_bound && last != NULL) {
        CachedBlock *prev = last->prev;
        if (last->state == READY && last->readers == 0) {
            unlink_block(s, last);
            s->cache_bytes -= last->bytes;
            block_free(last);
        }
        last = prev;
    }
}

/* Turn fill's answer into a block's files: 0, or -1 if it lies (checked against `row`). */
static int take_files(PyObject *r, CachedBlock *b, uint64_t row)
{
    Py_buffer offsets, data;
    uint64_t first, count, i;
    const uint64_t *o;
    int ok = 0;
    if (!PyTuple_Check(r) || PyTuple_GET_SIZE(r) != 3 || bridge_u64(PyTuple_GET_ITEM(r, 0), &first) != 0)
        return -1;
    if (PyObject_GetBuffer(PyTuple_GET_ITEM(r, 1), &offsets, PyBUF_C_CONTIGUOUS) != 0) {
        PyErr_Clear();
        return -1;
    }
    if (PyObject_GetBuffer(PyTuple_GET_ITEM(r, 2), &data, PyBUF_C_CONTIGUOUS) != 0) {
        PyErr_Clear();
        PyBuffer_Release(&offsets);
        return -1;
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
        b->data = malloc(data.len ? (size_t)data.len : 1);
        ok = b->offsets != NULL && b->data != NULL;
    }
    if (ok) {
        memcpy(b->offsets, o, (size_t)offsets.len);
        memcpy(b->data, data.buf, (size_t)data.len);
        b->first_row = first;
        b->count = count - 1;
        b->bytes = (size_t)data.len + (size_t)offsets.len + sizeof *b;
    }
    PyBuffer_Release(&offsets);
    PyBuffer_Release(&data);
    return ok ? 0 : -1;
}

int cache_read(Session *s, fuse_req_t req, fuse_ino_t ino, size_t size, off_t off)
{
    int64_t row;
    uint64_t shard, block, fsize;
    ShardTable *t = table_of(s, ino, &row);
    CachedBlock *b;
    int known = 0;
    if (t == NULL || row < 0 || off < 0)
        return 0;
    shard = (ino >> 32) - 1;
    pthread_rwlock_rdlock(&t->lock);
    if (t->kind.obj != NULL && t->block.obj != NULL && (uint64_t)row < t->n
        && ((const uint8_t *)t->kind.buf)[row] == 0) {
        fsize = ((const uint64_t *)t->size.buf)[row];
        block = ((const uint32_t *)t->block.buf)[row];
        known = fsize != UINT64_MAX;
    }
    pthread_rwlock_unlock(&t->lock);
    if (!known)
        return 0;
    pthread_mutex_lock(&s->cache_lock);
    for (;;) {
        b = find(s, shard, block);
        if (b == NULL || b->state == READY)
            break;
        pthread_cond_wait(&s->cache_filled, &s->cache_lock);  /* another worker fills it */
    }
    if (b == NULL) {
        /* A miss: this worker fills it, the others wait (a block is decoded once). */
        PyGILState_STATE gil;
        PyObject *r;
        int err = 0;
        b = calloc(1, sizeof *b);
        if (b == NULL) {
            pthread_mutex_unlock(&s->cache_lock);
            return -ENOMEM;
        }
        b->shard = shard;
        b->block = block;
        b->state = FILLING;
        push_front(s, b);
        pthread_mutex_unlock(&s->cache_lock);
        gil = bridge_enter();
        r = bridge_call(s, CB_FILL, Py_BuildValue("(nKLn)", (Py_ssize_t)shard, (unsigned long long)row,
                                                   (long long)off, (Py_ssize_t)size));
        if (r != NULL && PyBytes_Check(r)) {
            /* Only this read's bytes: answered now, nothing kept. */
            if ((size_t)PyBytes_GET_SIZE(r) > size) {
                err = EIO;
            } else {
                char *buf = bridge_scratch(PyBytes_GET_SIZE(r) ? (size_t)PyBytes_GET_SIZE(r) : 1);
                size_t got = (size_t)PyBytes_GET_SIZE(r);
                if (buf == NULL) {
                    err = ENOMEM;
                } else {
                    memcpy(buf, PyBytes_AS_STRING(r), got);
                    Py_DECREF(r);
                    bridge_leave(gil);
                    pthread_mutex_lock(&s->cache_lock);
                    unlink_block(s, b);
                    block_free(b);
                    pthread_cond_broadcast(&s->cache_filled);
                    pthread_mutex_unlock(&s->cache_lock);
                    COUNT(s, ST_READ, 0);
                    fuse_reply_buf(req, buf, got);
                    return 1;
                }
            }
        } else if (r == NULL || take_files(r, b, (uint64_t)row) != 0) {
            err = r != NULL && PyLong_Check(r) ? bridge_errno(r, "fill") : EIO;
        }
        Py_XDECREF(r);
        bridge_leave(gil);
        pthread_mutex_lock(&s->cache_lock);
        if (err) {
            unlink_block(s, b);
            block_free(b);
            pthread_cond_broadcast(&s->cache_filled);
            pthread_mutex_unlock(&s->cache_lock);
            COUNT(s, ST_READ, 0);
            return -err;
        }
        b->state = READY;
        s->cache_bytes += b->bytes;
        pthread_cond_broadcast(&s->cache_filled);
    } else {
        unlink_block(s, b);
        push_front(s, b);
    }
    if ((uint64_t)row < b->first_row || (uint64_t)row - b->first_row >= b->count) {
        /* Filled for other rows (not this one's block after all): the control plane answers. */
        pthread_mutex_unlock(&s->cache_lock);
        return 0;
    }
    b->readers++;
    shrink(s);
    pthread_mutex_unlock(&s->cache_lock);
    {
        uint64_t i = (uint64_t)row - b->first_row, start = b->offsets[i], end = b->offsets[i + 1];
        int lies = end - start != fsize;
        if (!lies) {
            uint64_t from = (uint64_t)off < fsize ? (uint64_t)off : fsize;
            uint64_t n = fsize - from < size ? fsize - from : size;
            fuse_reply_buf(req, b->data + start + from, (size_t)n);  /* ours until readers drops */
        }
        pthread_mutex_lock(&s->cache_lock);
        b->readers--;
        shrink(s);
        pthread_mutex_unlock(&s->cache_lock);
        COUNT(s, ST_READ, 1);
        if (lies)
            return -EIO;
    }
    return 1;
}
