/* The byte cache: what reads of a shard whose table is attached are answered from in C,
 * without the GIL. An entry is a block's encoded files (KIND_FILES, filled by the control
 * plane), or, filled in C by located.c, a block's decompressed bytes (KIND_PAYLOAD), the
 * map of its zstd frame (KIND_FRAME), one file read alone (KIND_RUN, keyed by its row) or
 * its kept files decompressed from the table (KIND_KEPT).
 *
 * Keyed by (shard, kind, block) in a hash table, bounded in bytes (least recently used
 * entries go first, never one a reader is copying from). An entry is filled by the one
 * worker that missed it first (cache_acquire says so); the other workers missing it wait:
 * a block is decoded, or decompressed, once. On a miss of a block's files that located.c
 * could not answer, `fill(shard, row, offset, size)` asks the control plane: it answers the
 * block's files, (first row, offsets, bytes) of a run of consecutive rows, which are kept,
 * or only this read's bytes (its own policy), which are not. Everything fill answers is
 * checked (rows, offsets, lengths against the table's sizes) before it is kept.
 */
#include "engine.h"

#include <errno.h>
#include <malloc.h>
#include <stdlib.h>
#include <string.h>

/* Hash buckets (a power of two): chains stay short up to tens of thousands of entries. */
#define BUCKETS 8192

int cache_init(Session *s, size_t bound)
{
    s->cache_bound = bound;
    s->cache_bytes = 0;
    s->cache_evicted = s->cache_trimmed_at = 0;
    s->cache_flight = 0;
    s->reserve_next = s->reserve_turn = 0;
    s->cache_idle = 0;
    s->pool_bytes = 0;
    memset(s->pool, 0, sizeof s->pool);
    s->cache_head = s->cache_tail = NULL;
    s->cache_buckets = calloc(BUCKETS, sizeof *s->cache_buckets);
    if (s->cache_buckets == NULL)
        return -1;
    if (pthread_mutex_init(&s->cache_lock, NULL) != 0 || pthread_cond_init(&s->cache_filled, NULL) != 0
        || pthread_cond_init(&s->cache_room, NULL) != 0)
        return -1;
    return 0;
}

/* The buffer pool: payloads are megabytes, and a fresh buffer for each (malloc's mmap, its
 * pages faulted in as they are written, munmap at free) cost more than decompressing them. A
 * payload's buffer, once evicted, is kept for the next one, within POOL_MAX and half the bound. */
#define POOL_SLOTS 8
#define POOL_MAX ((size_t)32 << 20)
/* Buffers are made in steps of this many bytes, so that an evicted one fits the next payload. */
#define POOL_STEP ((size_t)512 << 10)

static size_t pool_limit(const Session *s)
{
    return s->cache_bound / 2 < POOL_MAX ? s->cache_bound / 2 : POOL_MAX;
}

/* Lock held. */
static void pool_put_locked(Session *s, char *data, size_t capacity)
{
    size_t i;
    if (data == NULL)
        return;
    if (capacity <= pool_limit(s) && s->pool_bytes <= pool_limit(s) - capacity)
        for (i = 0; i < POOL_SLOTS; i++)
            if (s->pool[i] == NULL) {
                s->pool[i] = data;
                s->pool_cap[i] = capacity;
                s->pool_bytes += capacity;
                return;
            }
    free(data);
}

void buffer_put(Session *s, char *data, size_t capacity)
{
    pthread_mutex_lock(&s->cache_lock);
    pool_put_locked(s, data, capacity);
    pthread_mutex_unlock(&s->cache_lock);
}

char *buffer_get(Session *s, size_t size, size_t *capacity)
{
    size_t i, best = POOL_SLOTS, rounded;
    char *data = NULL;
    pthread_mutex_lock(&s->cache_lock);
    /* The smallest that fits, and at most twice the size: a buffer is charged to the cache at
     * its capacity (a partial payload in a 32 MiB buffer would count 32 MiB). */
    for (i = 0; i < POOL_SLOTS; i++)
        if (s->pool[i] != NULL && s->pool_cap[i] >= size && s->pool_cap[i] / 2 <= size
            && (best == POOL_SLOTS || s->pool_cap[i] < s->pool_cap[best]))
            best = i;
    if (best < POOL_SLOTS) {
        data = s->pool[best];
        *capacity = s->pool_cap[best];
        s->pool[best] = NULL;
        s->pool_bytes -= *capacity;
    }
    pthread_mutex_unlock(&s->cache_lock);
    if (data != NULL)
        return data;
    rounded = size <= SIZE_MAX - POOL_STEP ? (size + POOL_STEP - 1) / POOL_STEP * POOL_STEP : size;
    if (rounded == 0)
        rounded = 1;
    *capacity = rounded;
    return malloc(rounded);
}

/* Lock held: a payload's buffer goes back to the pool. */
static void block_free(Session *s, CachedBlock *b)
{
    free(b->offsets);
    if (b->kind == KIND_PAYLOAD && !b->sparse && b->capacity > 0)
        pool_put_locked(s, b->data, b->capacity);
    else
        free(b->data);
    free(b);
}

static size_t bucket_of(uint64_t shard, int kind, uint64_t block)
{
    uint64_t h = (shard + 1) * UINT64_C(0x9E3779B97F4A7C15) ^ (block * 8 + (uint64_t)kind) * UINT64_C(0xC2B2AE3D27D4EB4F);
    return (size_t)(h >> 40) & (BUCKETS - 1);
}

/* Lock held, for all below. */
static CachedBlock *find(Session *s, uint64_t shard, int kind, uint64_t block)
{
    CachedBlock *b;
    for (b = s->cache_buckets[bucket_of(shard, kind, block)]; b != NULL; b = b->hnext)
        if (b->shard == shard && b->block == block && b->kind == kind)
            return b;
    return NULL;
}

static void lru_unlink(Session *s, CachedBlock *b)
{
    if (b->prev != NULL)
        b->prev->next = b->next;
    else
        s->cache_head = b->next;
    if (b->next != NULL)
        b->next->prev = b->prev;
    else
        s->cache_tail = b->prev;
    b->next = b->prev = NULL;
}

static void lru_push_front(Session *s, CachedBlock *b)
{
    b->prev = NULL;
    b->next = s->cache_head;
    if (s->cache_head != NULL)
        s->cache_head->prev = b;
    else
        s->cache_tail = b;
    s->cache_head = b;
}

/* Whether the entry (in the cache) could be evicted now: ready, and no one reads it. shrink
 * looks for nothing while none is (s->cache_idle counts them). */
static int idle(const CachedBlock *b)
{
    return b->state == READY && b->readers == 0;
}

static void insert(Session *s, CachedBlock *b)
{
    CachedBlock **head = &s->cache_buckets[bucket_of(b->shard, b->kind, b->block)];
    b->hnext = *head;
    *head = b;
    lru_push_front(s, b);
    s->cache_idle += idle(b);
}

/* A reader more of an entry in the cache. */
static void read_more(Session *s, CachedBlock *b)
{
    s->cache_idle -= idle(b);
    b->readers++;
}

/* Out of the hash table and the LRU list. */
static void unlink_entry(Session *s, CachedBlock *b)
{
    CachedBlock **at = &s->cache_buckets[bucket_of(b->shard, b->kind, b->block)];
    while (*at != NULL && *at != b)
        at = &(*at)->hnext;
    if (*at == b)
        *at = b->hnext;
    lru_unlink(s, b);
    s->cache_idle -= idle(b);
}

/* Freed; the bytes it was charged given back. */
static void release_entry(Session *s, CachedBlock *b)
{
    if (b->state == READY && !b->in_flight) {
        s->cache_bytes -= b->bytes;
        __atomic_add_fetch(&s->cache_evicted, b->bytes, __ATOMIC_RELAXED);
    }
    block_free(s, b);
}

/* Out of the cache and freed. */
static void drop(Session *s, CachedBlock *b)
{
    unlink_entry(s, b);
    release_entry(s, b);
}

/* Out of the cache, for a longer one in its place: freed now if no one reads it, else by its
 * last reader (cache_release); charged until then. */
static void orphan(Session *s, CachedBlock *b)
{
    unlink_entry(s, b);
    if (b->readers == 0)
        release_entry(s, b);
    else
        b->orphan = 1;
}

/* Lock not held (one thread wins the turn). Once half the bound was evicted since last time,
 * hand the freed memory back to the system: entries of every size freed by every worker leave
 * holes in glibc's arenas (one per thread) that later entries only partly fill, as the tree's
 * cache does in Python (atlasfs/memory.py). */
static void give_back(Session *s)
{
    size_t evicted = __atomic_load_n(&s->cache_evicted, __ATOMIC_RELAXED);
    size_t at = __atomic_load_n(&s->cache_trimmed_at, __ATOMIC_RELAXED);
    if (evicted - at < s->cache_bound / 2 + 1
        || !__atomic_compare_exchange_n(&s->cache_trimmed_at, &at, evicted, 0, __ATOMIC_RELAXED, __ATOMIC_RELAXED))
        return;
    malloc_trim(0);
}

void cache_free(Session *s)
{
    size_t i;
    while (s->cache_head != NULL)
        drop(s, s->cache_head);
    for (i = 0; i < POOL_SLOTS; i++) {
        free(s->pool[i]);
        s->pool[i] = NULL;
    }
    s->pool_bytes = 0;
    free(s->cache_buckets);
    s->cache_buckets = NULL;
    pthread_mutex_destroy(&s->cache_lock);
    pthread_cond_destroy(&s->cache_filled);
    pthread_cond_destroy(&s->cache_room);
}

/* Whether the entries and the payloads in flight are past the bound. */
static int over(const Session *s)
{
    return s->cache_flight > s->cache_bound || s->cache_bytes > s->cache_bound - s->cache_flight;
}

/* How far from the LRU list's tail shrink looks for the payload that has the least left to give. */
#define VICTIM_WINDOW 256

/* Of the ready payloads no one reads among the VICTIM_WINDOW least recently used entries, the
 * one with the fewest bytes not yet served from it, or NULL. A shuffled pass reads each file of
 * a block once: a block whose files were all read has nothing left for this pass, and one with
 * more left to give is likelier to be read again before it would be made again. */
static CachedBlock *spent_payload(Session *s)
{
    CachedBlock *b, *best = NULL;
    uint64_t best_left = UINT64_MAX;
    int n = 0;
    for (b = s->cache_tail; b != NULL && n < VICTIM_WINDOW; b = b->prev, n++) {
        uint64_t served, left;
        if (b->kind != KIND_PAYLOAD || b->state != READY || b->readers != 0)
            continue;
        served = __atomic_load_n(&b->served, __ATOMIC_RELAXED);
        left = served < b->length ? b->length - served : 0;
        if (left < best_left) {
            best = b;
            best_left = left;
        }
    }
    return best;
}

/* Evict ready entries no one reads to stay within the bound (what is left of it beside the
 * payloads in flight): files kept for their next pieces first (KIND_RUN, least recently used
 * first: a file's next piece comes soon after its first), then payloads, the most spent first
 * (spent_payload), then the least recently used, frames' maps last. A payload larger than the
 * whole bound (made alone) does not take the maps with it while it is made and served: they
 * are what lets the next reads of raw zstd blocks go without decompressing (once it is given
 * back, they too stay only within the bound). */
static void shrink(Session *s)
{
    CachedBlock *b;
    int maps;
    if (s->cache_idle == 0)
        return;  /* nothing to evict: no walk of the whole list (every release calls this) */
    for (b = s->cache_tail; over(s) && b != NULL;) {
        CachedBlock *prev = b->prev;
        if (b->kind == KIND_RUN && b->state == READY && b->readers == 0)
            drop(s, b);
        b = prev;
    }
    while (over(s) && (b = spent_payload(s)) != NULL)
        drop(s, b);
    for (maps = 0; maps < 2; maps++) {
        if (maps && s->cache_flight > s->cache_bound)
            break;  /* evicted, if they must be, once that payload was given back */
        b = s->cache_tail;
        while (over(s) && b != NULL) {
            CachedBlock *prev = b->prev;
            if (b->state == READY && b->readers == 0 && (b->kind == KIND_FRAME) == maps)
                drop(s, b);
            b = prev;
        }
    }
}

/* The ready entry (shard, kind, block) held for reading (a reader more, the most recently
 * used), or NULL; with `wait`, one another worker is filling is waited for. Lock held. */
static CachedBlock *take_locked(Session *s, uint64_t shard, int kind, uint64_t block, int wait)
{
    CachedBlock *b;
    while ((b = find(s, shard, kind, block)) != NULL && b->state != READY && wait)
        pthread_cond_wait(&s->cache_filled, &s->cache_lock);
    if (b == NULL || b->state != READY)
        return NULL;
    read_more(s, b);
    lru_unlink(s, b);
    lru_push_front(s, b);
    return b;
}

static CachedBlock *take(Session *s, uint64_t shard, int kind, uint64_t block, int wait)
{
    CachedBlock *b;
    pthread_mutex_lock(&s->cache_lock);
    b = take_locked(s, shard, kind, block, wait);
    pthread_mutex_unlock(&s->cache_lock);
    return b;
}

/* A new entry for (shard, kind, block), being filled by the caller (its one reader); the lock
 * held. NULL: out of memory. */
static CachedBlock *add_filling(Session *s, uint64_t shard, int kind, uint64_t block)
{
    CachedBlock *b = calloc(1, sizeof *b);
    if (b != NULL) {
        b->shard = shard;
        b->block = block;
        b->kind = kind;
        b->state = FILLING;
        b->readers = 1;
        insert(s, b);
    }
    return b;
}

CachedBlock *cache_acquire(Session *s, uint64_t shard, int kind, uint64_t block, int *mine)
{
    CachedBlock *b;
    *mine = 0;
    pthread_mutex_lock(&s->cache_lock);
    b = take_locked(s, shard, kind, block, 1);
    if (b == NULL && (b = add_filling(s, shard, kind, block)) != NULL)
        *mine = 1;
    pthread_mutex_unlock(&s->cache_lock);
    return b;
}

CachedBlock *cache_peek(Session *s, uint64_t shard, int kind, uint64_t block)
{
    return take(s, shard, kind, block, 0);
}

CachedBlock *cache_acquire_min(Session *s, uint64_t shard, int kind, uint64_t block, size_t min_length, int *mine,
                               int *waited)
{
    CachedBlock *b;
    *mine = *waited = 0;
    pthread_mutex_lock(&s->cache_lock);
    while ((b = find(s, shard, kind, block)) != NULL && b->state != READY) {
        *waited = 1;  /* another worker makes it: never twice at once */
        pthread_cond_wait(&s->cache_filled, &s->cache_lock);
    }
    if (b != NULL && b->length >= min_length) {
        read_more(s, b);
        lru_unlink(s, b);
        lru_push_front(s, b);
    } else {
        if (b != NULL)
            orphan(s, b);
        if ((b = add_filling(s, shard, kind, block)) != NULL)
            *mine = 1;
    }
    pthread_mutex_unlock(&s->cache_lock);
    return b;
}

void cache_put(Session *s, uint64_t shard, int kind, uint64_t block, char *data, size_t length)
{
    CachedBlock *b;
    pthread_mutex_lock(&s->cache_lock);
    b = find(s, shard, kind, block);
    if (b != NULL && b->state == READY && b->length < length) {
        orphan(s, b);  /* freed now, or by its last reader */
        b = NULL;
    }
    if (b == NULL && (b = calloc(1, sizeof *b)) != NULL) {
        b->shard = shard;
        b->block = block;
        b->kind = kind;
        b->data = data;
        b->length = b->capacity = length;
        b->bytes = length + sizeof *b;
        b->state = READY;
        insert(s, b);
        s->cache_bytes += b->bytes;
        data = NULL;
        shrink(s);
    }
    pthread_mutex_unlock(&s->cache_lock);
    free(data);
}

void cache_complete(Session *s, CachedBlock *b, char *data, size_t length)
{
    cache_complete_sized(s, b, data, length, length);
}

static void complete(Session *s, CachedBlock *b, char *data, size_t length, size_t capacity, int reserved)
{
    pthread_mutex_lock(&s->cache_lock);
    b->data = data;
    b->length = length;
    b->capacity = capacity > length || b->sparse ? capacity : length;
    b->bytes = b->capacity + (b->count + 1) * sizeof(uint64_t) * (b->offsets != NULL) + sizeof *b;
    b->state = READY;  /* its filler reads it: not idle */
    b->in_flight = reserved;
    if (!reserved)
        s->cache_bytes += b->bytes;
    pthread_cond_broadcast(&s->cache_filled);
    shrink(s);
    pthread_mutex_unlock(&s->cache_lock);
}

void cache_complete_sized(Session *s, CachedBlock *b, char *data, size_t length, size_t capacity)
{
    complete(s, b, data, length, capacity, 0);
}

void cache_complete_reserved(Session *s, CachedBlock *b, char *data, size_t length, size_t capacity)
{
    complete(s, b, data, length, capacity, 1);
}

void cache_settle(Session *s, CachedBlock *b, size_t reserved)
{
    pthread_mutex_lock(&s->cache_lock);
    s->cache_flight -= reserved < s->cache_flight ? reserved : s->cache_flight;
    if (b->in_flight) {
        b->in_flight = 0;
        s->cache_bytes += b->bytes;
    }
    pthread_cond_broadcast(&s->cache_room);
    shrink(s);
    pthread_mutex_unlock(&s->cache_lock);
    give_back(s);
}

void cache_abandon(Session *s, CachedBlock *b)
{
    pthread_mutex_lock(&s->cache_lock);
    drop(s, b);
    pthread_cond_broadcast(&s->cache_filled);
    pthread_mutex_unlock(&s->cache_lock);
}

void cache_reserve(Session *s, size_t bytes)
{
    uint64_t ticket;
    pthread_mutex_lock(&s->cache_lock);
    /* Room if the others' payloads and this one fit half the bound (the other half stays for
     * the payloads kept: 4 readers making theirs at once evicted them all); none in flight:
     * room whatever this one's size (a worker reserves only while it holds no other
     * reservation: it never waits for itself, and every payload in flight is given back once
     * served). In turn, by ticket: a payload larger than half the bound waits for none to be in
     * flight, and small ones arriving meanwhile queue behind it instead of starving it. */
    ticket = s->reserve_next++;
    while (ticket != s->reserve_turn
           || (s->cache_flight > 0 && (bytes > s->cache_bound / 2 || s->cache_flight > s->cache_bound / 2 - bytes)))
        pthread_cond_wait(&s->cache_room, &s->cache_lock);
    s->reserve_turn++;
    s->cache_flight += bytes;
    pthread_cond_broadcast(&s->cache_room);  /* the next ticket may fit beside this one */
    shrink(s);
    pthread_mutex_unlock(&s->cache_lock);
}

void cache_unreserve(Session *s, size_t bytes)
{
    pthread_mutex_lock(&s->cache_lock);
    s->cache_flight -= bytes < s->cache_flight ? bytes : s->cache_flight;
    pthread_cond_broadcast(&s->cache_room);
    shrink(s);
    pthread_mutex_unlock(&s->cache_lock);
    give_back(s);
}

void cache_release(Session *s, CachedBlock *b)
{
    pthread_mutex_lock(&s->cache_lock);
    b->readers--;
    if (b->orphan && b->readers == 0)
        release_entry(s, b);
    else if (!b->orphan)
        s->cache_idle += idle(b);
    shrink(s);
    pthread_mutex_unlock(&s->cache_lock);
    give_back(s);
}

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
        cache_release(s, b);  /* filled for other rows: not this one's block after all */
        return 0;
    }
    i = row - b->first_row;
    start = b->offsets[i];
    end = b->offsets[i + 1];
    if (end - start != fsize) {
        cache_release(s, b);
        COUNT(s, ST_READ, 1);
        return -EIO;
    }
    {
        uint64_t from = (uint64_t)off < fsize ? (uint64_t)off : fsize;
        uint64_t n = fsize - from < size ? fsize - from : size;
        fuse_reply_buf(req, b->data + start + from, (size_t)n);  /* ours until readers drops */
    }
    cache_release(s, b);
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
            cache_abandon(s, b);
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
        cache_abandon(s, b);
        COUNT(s, ST_READ, 0);
        return -err;
    }
    cache_complete(s, b, kept, length);
    return serve_files(s, req, b, row, fsize, size, off);
}

int cache_read(Session *s, fuse_req_t req, fuse_ino_t ino, size_t size, off_t off)
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
    b = take(s, shard, KIND_FILES, block, 1);
    if (b != NULL)
        return serve_files(s, req, b, (uint64_t)row, fsize, size, off);
    answered = located_read(s, t, req, shard, (uint64_t)row, block, fsize, size, off);
    if (answered != 0)
        return answered;
    b = cache_acquire(s, shard, KIND_FILES, block, &mine);
    if (b == NULL)
        return -ENOMEM;
    if (!mine)
        return serve_files(s, req, b, (uint64_t)row, fsize, size, off);
    return fill(s, req, b, shard, (uint64_t)row, fsize, size, off);
}
