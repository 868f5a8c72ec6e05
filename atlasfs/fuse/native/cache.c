/* The byte cache (cache.h): what reads of a shard whose table is attached are answered from
 * in C, without the GIL (readpath.c, located.c). An entry is a block's encoded files
 * (KIND_FILES), a block's decompressed bytes (KIND_PAYLOAD), the map of its zstd frame
 * (KIND_FRAME), one file read alone (KIND_RUN, keyed by its row) or its kept files
 * decompressed from the table (KIND_KEPT): bytes to this file, whose kinds only order
 * eviction.
 *
 * Keyed by (shard, kind, block) in a hash table, bounded in bytes (least recently used
 * entries go first, never one a reader is copying from). An entry is filled by the one
 * worker that missed it first (cache_acquire says so); the other workers missing it wait:
 * a block is decoded, or decompressed, once. Payloads being made reserve their bytes first
 * (cache_reserve), in turn.
 *
 * The mount has one bound for this cache and the control plane's block cache together: this
 * one holds it all, and lends the block cache what it keeps (cache_lend, cache_repay).
 */
#include "cache.h"

#include <malloc.h>
#include <stdlib.h>
#include <string.h>

/* Hash buckets (a power of two): chains stay short up to tens of thousands of entries. */
#define BUCKETS 8192

int cache_init(ByteCache *c, size_t bound)
{
    c->bound = c->total = bound;
    c->lent = c->peak = 0;
    c->bytes = 0;
    c->evicted = c->trimmed_at = 0;
    c->flight = 0;
    c->reserve_next = c->reserve_turn = 0;
    c->idle = 0;
    c->pool_bytes = 0;
    memset(c->pool, 0, sizeof c->pool);
    c->head = c->tail = NULL;
    c->buckets = calloc(BUCKETS, sizeof *c->buckets);
    if (c->buckets == NULL)
        return -1;
    if (pthread_mutex_init(&c->lock, NULL) != 0 || pthread_cond_init(&c->filled, NULL) != 0
        || pthread_cond_init(&c->room, NULL) != 0)
        return -1;
    return 0;
}

/* The buffer pool: payloads are megabytes, and a fresh buffer for each (malloc's mmap, its
 * pages faulted in as they are written, munmap at free) cost more than decompressing them. A
 * payload's buffer, once evicted, is kept for the next one, within POOL_MAX and half the bound. */
#define POOL_MAX ((size_t)32 << 20)
/* Buffers are made in steps of this many bytes, so that an evicted one fits the next payload. */
#define POOL_STEP ((size_t)512 << 10)

static size_t pool_limit(const ByteCache *c)
{
    /* A quarter of the whole bound: what half of this cache's share was when it had half of
     * the mount's bound (its free buffers are not charged to it). */
    return c->total / 4 < POOL_MAX ? c->total / 4 : POOL_MAX;
}

/* Lock held. */
static void pool_put_locked(ByteCache *c, char *data, size_t capacity)
{
    size_t i;
    if (data == NULL)
        return;
    if (capacity <= pool_limit(c) && c->pool_bytes <= pool_limit(c) - capacity)
        for (i = 0; i < POOL_SLOTS; i++)
            if (c->pool[i] == NULL) {
                c->pool[i] = data;
                c->pool_cap[i] = capacity;
                c->pool_bytes += capacity;
                return;
            }
    free(data);
}

void buffer_put(ByteCache *c, char *data, size_t capacity)
{
    pthread_mutex_lock(&c->lock);
    pool_put_locked(c, data, capacity);
    pthread_mutex_unlock(&c->lock);
}

char *buffer_get(ByteCache *c, size_t size, size_t *capacity)
{
    size_t i, best = POOL_SLOTS, rounded;
    char *data = NULL;
    pthread_mutex_lock(&c->lock);
    /* The smallest that fits, and at most twice the size: a buffer is charged to the cache at
     * its capacity (a partial payload in a 32 MiB buffer would count 32 MiB). */
    for (i = 0; i < POOL_SLOTS; i++)
        if (c->pool[i] != NULL && c->pool_cap[i] >= size && c->pool_cap[i] / 2 <= size
            && (best == POOL_SLOTS || c->pool_cap[i] < c->pool_cap[best]))
            best = i;
    if (best < POOL_SLOTS) {
        data = c->pool[best];
        *capacity = c->pool_cap[best];
        c->pool[best] = NULL;
        c->pool_bytes -= *capacity;
    }
    pthread_mutex_unlock(&c->lock);
    if (data != NULL)
        return data;
    rounded = size <= SIZE_MAX - POOL_STEP ? (size + POOL_STEP - 1) / POOL_STEP * POOL_STEP : size;
    if (rounded == 0)
        rounded = 1;
    *capacity = rounded;
    return malloc(rounded);
}

/* Lock held: a payload's buffer goes back to the pool. */
static void block_free(ByteCache *c, CachedBlock *b)
{
    free(b->offsets);
    if (b->kind == KIND_PAYLOAD && !b->sparse && b->capacity > 0)
        pool_put_locked(c, b->data, b->capacity);
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
static CachedBlock *find(ByteCache *c, uint64_t shard, int kind, uint64_t block)
{
    CachedBlock *b;
    for (b = c->buckets[bucket_of(shard, kind, block)]; b != NULL; b = b->hnext)
        if (b->shard == shard && b->block == block && b->kind == kind)
            return b;
    return NULL;
}

static void lru_unlink(ByteCache *c, CachedBlock *b)
{
    if (b->prev != NULL)
        b->prev->next = b->next;
    else
        c->head = b->next;
    if (b->next != NULL)
        b->next->prev = b->prev;
    else
        c->tail = b->prev;
    b->next = b->prev = NULL;
}

static void lru_push_front(ByteCache *c, CachedBlock *b)
{
    b->prev = NULL;
    b->next = c->head;
    if (c->head != NULL)
        c->head->prev = b;
    else
        c->tail = b;
    c->head = b;
}

/* Whether the entry (in the cache) could be evicted now: ready, and no one reads it. shrink
 * looks for nothing while none is (c->idle counts them). */
static int idle(const CachedBlock *b)
{
    return b->state == READY && b->readers == 0;
}

static void insert(ByteCache *c, CachedBlock *b)
{
    CachedBlock **head = &c->buckets[bucket_of(b->shard, b->kind, b->block)];
    b->hnext = *head;
    *head = b;
    lru_push_front(c, b);
    c->idle += idle(b);
}

/* A reader more of an entry in the cache. */
static void read_more(ByteCache *c, CachedBlock *b)
{
    c->idle -= idle(b);
    b->readers++;
}

/* Out of the hash table and the LRU list. */
static void unlink_entry(ByteCache *c, CachedBlock *b)
{
    CachedBlock **at = &c->buckets[bucket_of(b->shard, b->kind, b->block)];
    while (*at != NULL && *at != b)
        at = &(*at)->hnext;
    if (*at == b)
        *at = b->hnext;
    lru_unlink(c, b);
    c->idle -= idle(b);
}

/* Freed; the bytes it was charged given back. */
static void release_entry(ByteCache *c, CachedBlock *b)
{
    if (b->state == READY && !b->in_flight) {
        c->bytes -= b->bytes;
        __atomic_add_fetch(&c->evicted, b->bytes, __ATOMIC_RELAXED);
    }
    block_free(c, b);
}

/* Out of the cache and freed. */
static void drop(ByteCache *c, CachedBlock *b)
{
    unlink_entry(c, b);
    release_entry(c, b);
}

/* Out of the cache, for a longer one in its place: freed now if no one reads it, else by its
 * last reader (cache_release); charged until then. */
static void orphan(ByteCache *c, CachedBlock *b)
{
    unlink_entry(c, b);
    if (b->readers == 0)
        release_entry(c, b);
    else
        b->orphan = 1;
}

/* Lock not held (one thread wins the turn). Once half the bound was evicted since last time,
 * hand the freed memory back to the system: entries of every size freed by every worker leave
 * holes in glibc's arenas (one per thread) that later entries only partly fill, as the tree's
 * cache does in Python (atlasfs/memory.py). */
static void give_back(ByteCache *c)
{
    size_t evicted = __atomic_load_n(&c->evicted, __ATOMIC_RELAXED);
    size_t at = __atomic_load_n(&c->trimmed_at, __ATOMIC_RELAXED);
    if (evicted - at < c->total / 2 + 1
        || !__atomic_compare_exchange_n(&c->trimmed_at, &at, evicted, 0, __ATOMIC_RELAXED, __ATOMIC_RELAXED))
        return;
    malloc_trim(0);
}

void cache_free(ByteCache *c)
{
    size_t i;
    while (c->head != NULL)
        drop(c, c->head);
    for (i = 0; i < POOL_SLOTS; i++) {
        free(c->pool[i]);
        c->pool[i] = NULL;
    }
    c->pool_bytes = 0;
    free(c->buckets);
    c->buckets = NULL;
    pthread_mutex_destroy(&c->lock);
    pthread_cond_destroy(&c->filled);
    pthread_cond_destroy(&c->room);
}

/* The most the entries, the payloads in flight and what is lent held together (Session.cache:
 * the mount's two caches never held more). Lock held. */
static void note_peak(ByteCache *c)
{
    size_t held = c->bytes + c->flight + c->lent;
    if (held > c->peak)
        c->peak = held;
}

/* Whether the entries and the payloads in flight are past the bound. */
static int over(const ByteCache *c)
{
    return c->flight > c->bound || c->bytes > c->bound - c->flight;
}

/* How far from the LRU list's tail shrink looks for the payload that has the least left to give. */
#define VICTIM_WINDOW 256

/* Of the ready payloads no one reads among the VICTIM_WINDOW least recently used entries, the
 * one with the fewest bytes not yet served from it, or NULL. A shuffled pass reads each file of
 * a block once: a block whose files were all read has nothing left for this pass, and one with
 * more left to give is likelier to be read again before it would be made again. */
static CachedBlock *spent_payload(ByteCache *c)
{
    CachedBlock *b, *best = NULL;
    uint64_t best_left = UINT64_MAX;
    int n = 0;
    for (b = c->tail; b != NULL && n < VICTIM_WINDOW; b = b->prev, n++) {
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
static void evict_idle(ByteCache *c)
{
    CachedBlock *b;
    int maps;
    if (c->idle == 0)
        return;  /* nothing to evict: no walk of the whole list (every release calls this) */
    for (b = c->tail; over(c) && b != NULL;) {
        CachedBlock *prev = b->prev;
        if (b->kind == KIND_RUN && b->state == READY && b->readers == 0)
            drop(c, b);
        b = prev;
    }
    while (over(c) && (b = spent_payload(c)) != NULL)
        drop(c, b);
    for (maps = 0; maps < 2; maps++) {
        if (maps && c->flight > c->bound)
            break;  /* evicted, if they must be, once that payload was given back */
        b = c->tail;
        while (over(c) && b != NULL) {
            CachedBlock *prev = b->prev;
            if (b->state == READY && b->readers == 0 && (b->kind == KIND_FRAME) == maps)
                drop(c, b);
            b = prev;
        }
    }
}

/* Evict to stay within the bound (evict_idle), then note the peak. */
static void shrink(ByteCache *c)
{
    evict_idle(c);
    note_peak(c);
}

/* The ready entry (shard, kind, block) held for reading (a reader more, the most recently
 * used), or NULL; with `wait`, one another worker is filling is waited for. Lock held. */
static CachedBlock *take_locked(ByteCache *c, uint64_t shard, int kind, uint64_t block, int wait)
{
    CachedBlock *b;
    while ((b = find(c, shard, kind, block)) != NULL && b->state != READY && wait) {
        c->waiting++;
        pthread_cond_wait(&c->filled, &c->lock);
        c->waiting--;
    }
    if (b == NULL || b->state != READY)
        return NULL;
    read_more(c, b);
    lru_unlink(c, b);
    lru_push_front(c, b);
    return b;
}

static CachedBlock *take(ByteCache *c, uint64_t shard, int kind, uint64_t block, int wait)
{
    CachedBlock *b;
    pthread_mutex_lock(&c->lock);
    b = take_locked(c, shard, kind, block, wait);
    pthread_mutex_unlock(&c->lock);
    return b;
}

/* A new entry for (shard, kind, block), being filled by the caller (its one reader); the lock
 * held. NULL: out of memory. */
static CachedBlock *add_filling(ByteCache *c, uint64_t shard, int kind, uint64_t block)
{
    CachedBlock *b = calloc(1, sizeof *b);
    if (b != NULL) {
        b->shard = shard;
        b->block = block;
        b->kind = kind;
        b->state = FILLING;
        b->readers = 1;
        insert(c, b);
    }
    return b;
}

CachedBlock *cache_acquire(ByteCache *c, uint64_t shard, int kind, uint64_t block, int *mine)
{
    CachedBlock *b;
    *mine = 0;
    pthread_mutex_lock(&c->lock);
    b = take_locked(c, shard, kind, block, 1);
    if (b == NULL && (b = add_filling(c, shard, kind, block)) != NULL)
        *mine = 1;
    pthread_mutex_unlock(&c->lock);
    return b;
}

CachedBlock *cache_peek(ByteCache *c, uint64_t shard, int kind, uint64_t block)
{
    return take(c, shard, kind, block, 0);
}

CachedBlock *cache_wait(ByteCache *c, uint64_t shard, int kind, uint64_t block)
{
    return take(c, shard, kind, block, 1);
}

CachedBlock *cache_acquire_min(ByteCache *c, uint64_t shard, int kind, uint64_t block, size_t min_length, int *mine,
                               int *waited)
{
    CachedBlock *b;
    *mine = *waited = 0;
    pthread_mutex_lock(&c->lock);
    while ((b = find(c, shard, kind, block)) != NULL
           && (b->state != READY || (b->growing && b->length < min_length))) {
        *waited = 1;  /* another worker makes it (or the rest of it): never twice at once */
        c->waiting++;
        pthread_cond_wait(&c->filled, &c->lock);
        c->waiting--;
    }
    if (b != NULL && b->length >= min_length) {
        read_more(c, b);
        lru_unlink(c, b);
        lru_push_front(c, b);
    } else {
        if (b != NULL)
            orphan(c, b);
        if ((b = add_filling(c, shard, kind, block)) != NULL)
            *mine = 1;
    }
    pthread_mutex_unlock(&c->lock);
    return b;
}

void cache_put(ByteCache *c, uint64_t shard, int kind, uint64_t block, char *data, size_t length)
{
    CachedBlock *b;
    pthread_mutex_lock(&c->lock);
    b = find(c, shard, kind, block);
    if (b != NULL && b->state == READY && b->length < length) {
        orphan(c, b);  /* freed now, or by its last reader */
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
        insert(c, b);
        c->bytes += b->bytes;
        data = NULL;
        shrink(c);
    }
    pthread_mutex_unlock(&c->lock);
    free(data);
}

void cache_complete(ByteCache *c, CachedBlock *b, char *data, size_t length)
{
    cache_complete_sized(c, b, data, length, length);
}

static void complete(ByteCache *c, CachedBlock *b, char *data, size_t length, size_t capacity, int reserved)
{
    pthread_mutex_lock(&c->lock);
    b->data = data;
    b->length = length;
    b->capacity = capacity > length || b->sparse ? capacity : length;
    b->bytes = b->capacity + (b->count + 1) * sizeof(uint64_t) * (b->offsets != NULL) + sizeof *b;
    b->state = READY;  /* its filler reads it: not idle */
    b->in_flight = reserved;
    if (!reserved)
        c->bytes += b->bytes;
    pthread_cond_broadcast(&c->filled);
    shrink(c);
    pthread_mutex_unlock(&c->lock);
}

void cache_complete_sized(ByteCache *c, CachedBlock *b, char *data, size_t length, size_t capacity)
{
    complete(c, b, data, length, capacity, 0);
}

void cache_complete_reserved(ByteCache *c, CachedBlock *b, char *data, size_t length, size_t capacity)
{
    complete(c, b, data, length, capacity, 1);
}

void cache_complete_growing(ByteCache *c, CachedBlock *b, char *data, size_t length, size_t capacity)
{
    pthread_mutex_lock(&c->lock);
    b->growing = 1;  /* before it is ready: no reader sees it ready and not growing */
    pthread_mutex_unlock(&c->lock);
    complete(c, b, data, length, capacity, 1);
}

void cache_grown(ByteCache *c, CachedBlock *b, size_t length)
{
    pthread_mutex_lock(&c->lock);
    if (length > b->length)
        __atomic_store_n(&b->length, length, __ATOMIC_RELEASE);  /* its readers read it unlocked */
    b->growing = 0;
    pthread_cond_broadcast(&c->filled);
    shrink(c);
    pthread_mutex_unlock(&c->lock);
}

CachedBlock *cache_replace_grown(ByteCache *c, CachedBlock *b, char *data, size_t length, size_t capacity)
{
    CachedBlock *n = calloc(1, sizeof *n);
    if (n == NULL)
        return NULL;
    n->shard = b->shard;
    n->block = b->block;
    n->kind = b->kind;
    n->data = data;
    n->length = length;
    n->capacity = capacity;
    n->sparse = 1;
    n->bytes = capacity + sizeof *n;
    n->state = READY;
    n->readers = 1;  /* the filler's, until it lets go of it: not evicted before its waiters take it */
    pthread_mutex_lock(&c->lock);
    b->growing = 0;
    n->served = __atomic_load_n(&b->served, __ATOMIC_RELAXED);
    if (!b->orphan)
        orphan(c, b);  /* out of the cache first: find() gives the new one */
    insert(c, n);
    c->bytes += n->bytes;
    pthread_cond_broadcast(&c->filled);
    shrink(c);
    pthread_mutex_unlock(&c->lock);
    return n;
}

void cache_settle(ByteCache *c, CachedBlock *b, size_t reserved)
{
    pthread_mutex_lock(&c->lock);
    c->flight -= reserved < c->flight ? reserved : c->flight;
    if (b->in_flight) {
        b->in_flight = 0;
        c->bytes += b->bytes;
    }
    pthread_cond_broadcast(&c->room);
    shrink(c);
    pthread_mutex_unlock(&c->lock);
    give_back(c);
}

void cache_abandon(ByteCache *c, CachedBlock *b)
{
    pthread_mutex_lock(&c->lock);
    drop(c, b);
    pthread_cond_broadcast(&c->filled);
    pthread_mutex_unlock(&c->lock);
}

void cache_reserve(ByteCache *c, size_t bytes)
{
    uint64_t ticket;
    pthread_mutex_lock(&c->lock);
    /* Room if the others' payloads and this one fit half the bound (the other half stays for
     * the payloads kept: 4 readers making theirs at once evicted them all); none in flight:
     * room whatever this one's size (a worker reserves only while it holds no other
     * reservation: it never waits for itself, and every payload in flight is given back once
     * served). In turn, by ticket: a payload larger than half the bound waits for none to be in
     * flight, and small ones arriving meanwhile queue behind it instead of starving it. */
    ticket = c->reserve_next++;
    while (ticket != c->reserve_turn
           || (c->flight > 0 && (bytes > c->bound / 2 || c->flight > c->bound / 2 - bytes)))
        pthread_cond_wait(&c->room, &c->lock);
    c->reserve_turn++;
    c->flight += bytes;
    pthread_cond_broadcast(&c->room);  /* the next ticket may fit beside this one */
    shrink(c);
    pthread_mutex_unlock(&c->lock);
}

void cache_unreserve(ByteCache *c, size_t bytes)
{
    pthread_mutex_lock(&c->lock);
    c->flight -= bytes < c->flight ? bytes : c->flight;
    pthread_cond_broadcast(&c->room);
    shrink(c);
    pthread_mutex_unlock(&c->lock);
    give_back(c);
}

void cache_release(ByteCache *c, CachedBlock *b)
{
    pthread_mutex_lock(&c->lock);
    b->readers--;
    if (b->orphan && b->readers == 0)
        release_entry(c, b);
    else if (!b->orphan)
        c->idle += idle(b);
    shrink(c);
    pthread_mutex_unlock(&c->lock);
    give_back(c);
}

/* The bound this cache may hold now: the whole one less what is lent. */
static void set_bound(ByteCache *c)
{
    __atomic_store_n(&c->bound, c->total - c->lent, __ATOMIC_RELAXED);
}

size_t cache_lend(ByteCache *c, size_t bytes)
{
    size_t used, room, granted;
    pthread_mutex_lock(&c->lock);
    if (bytes > c->total - c->lent)
        bytes = c->total - c->lent;
    /* As if lent: what no one reads is evicted to make room (payloads the most spent first,
     * frames' maps last, as for any other need of room); the rest is held. */
    __atomic_store_n(&c->bound, c->total - c->lent - bytes, __ATOMIC_RELAXED);
    evict_idle(c);
    used = c->bytes + c->flight;
    room = c->total - c->lent > used ? c->total - c->lent - used : 0;
    granted = bytes < room ? bytes : room;
    c->lent += granted;
    set_bound(c);
    note_peak(c);
    pthread_mutex_unlock(&c->lock);
    give_back(c);
    return granted;
}

void cache_repay(ByteCache *c, size_t bytes)
{
    pthread_mutex_lock(&c->lock);
    c->lent -= bytes < c->lent ? bytes : c->lent;
    set_bound(c);
    pthread_cond_broadcast(&c->room);  /* more room for payloads waiting to be made */
    pthread_mutex_unlock(&c->lock);
}
