/* The byte cache (cache.c): entries of bytes keyed by (shard, kind, block), bounded in bytes,
 * filled once however many workers miss them at once. It knows no table, no format, no zstd
 * and no FUSE: readpath.c and located.c decide what goes in it; tests/unit/fuse/cache_test.c
 * runs it alone.
 */
#ifndef ATLASFS_CACHE_H
#define ATLASFS_CACHE_H

#include <pthread.h>
#include <stddef.h>
#include <stdint.h>

/* What an entry holds, which is also how it is evicted (cache.c shrink): a block's encoded
 * files (rows first_row .. first_row + count - 1, readpath.c), a block's decompressed bytes
 * (its payload, located.c: only its compressed zstd blocks' bytes and its frame's map when it
 * is sparse; evicted the most spent first, its buffer kept for the next one), the map of its
 * zstd frame's blocks stored as is (located.c; evicted last), one file read alone (KIND_RUN,
 * keyed by its row instead of its block, located.c; evicted first), or the block's kept
 * files, decompressed from the table (KIND_KEPT, located.c). */
enum { KIND_FILES, KIND_PAYLOAD, KIND_FRAME, KIND_RUN, KIND_KEPT };
enum { FILLING, READY };

typedef struct CachedBlock CachedBlock;
struct CachedBlock {
    uint64_t shard, block, first_row, count;
    int kind;
    uint64_t *offsets;  /* KIND_FILES: count + 1, ascending, the last the data's length */
    char *data;
    size_t length;      /* bytes in data */
    size_t bytes;       /* what the entry costs the bound */
    size_t capacity;    /* bytes allocated at data (>= length; from the buffer pool or malloc) */
    uint64_t verified;  /* KIND_PAYLOAD: 1 + the row whose run was last checked in it */
    uint64_t served;    /* KIND_PAYLOAD: bytes of runs checked in it (what it gave; eviction's guide) */
    int state, readers;
    int orphan;         /* replaced by a longer one while read: freed by its last reader */
    int in_flight;      /* a payload completed while its bytes are still reserved (cache_reserve):
                         * charged to the bound as reserved, not twice (cache_settle) */
    int sparse;         /* KIND_PAYLOAD: the frame's map and only its compressed zstd blocks'
                         * bytes (located.c Sparse); `length` is then how far it maps */
    int growing;        /* KIND_PAYLOAD: ready up to `length` while its filler decompresses the
                         * rest of the frame into `data` past it (cache_complete_growing): readers
                         * needing no more read it meanwhile, the others wait (cache_acquire_min).
                         * `length` then changes under readers: read it with __atomic_load_n */
    CachedBlock *next, *prev;  /* the LRU list, most recently used first */
    CachedBlock *hnext;        /* the hash chain */
};

/* Free buffers kept for the next payloads (buffer_get, buffer_put). */
#define POOL_SLOTS 8

typedef struct {
    pthread_mutex_t lock;
    pthread_cond_t filled, room;
    CachedBlock *head, *tail, **buckets;
    /* `bound` is what this cache may hold now: `total`, the mount's one bound, less what it
     * lent (cache_lend) to the control plane's block cache. Written under the lock, read
     * anywhere (located.c's keep_whole). */
    size_t bytes, bound, total, lent;
    size_t peak;    /* the most of bytes + flight + lent seen after any change (Session.cache) */
    size_t flight;  /* bytes reserved for payloads being made and served (cache_reserve) */
    uint64_t reserve_next, reserve_turn;  /* cache_reserve's tickets: waiters served in turn */
    size_t idle;    /* entries ready in the cache that no one reads (what shrink can evict) */
    size_t waiting; /* workers waiting now for an entry another one fills (under the lock) */
    size_t evicted, trimmed_at;  /* bytes evicted so far, and when memory was last given back */
    /* At most POOL_SLOTS, pool_bytes within min(bound / 2, POOL_MAX), under the lock. */
    char *pool[POOL_SLOTS];
    size_t pool_cap[POOL_SLOTS], pool_bytes;
} ByteCache;

/* A cache of at most `bound` bytes: 0, or -1 (no memory, or no lock). */
int cache_init(ByteCache *c, size_t bound);
void cache_free(ByteCache *c);
/* The ready entry (shard, kind, block) held for reading, waiting for one being filled; or
 * NULL (none). */
CachedBlock *cache_wait(ByteCache *c, uint64_t shard, int kind, uint64_t block);
/* The ready entry held for reading (waiting for none), or NULL. */
CachedBlock *cache_peek(ByteCache *c, uint64_t shard, int kind, uint64_t block);
/* As cache_wait, but where there is none a new entry being filled by this worker (*mine 1),
 * which it completes (cache_complete...) or abandons. NULL: no memory. */
CachedBlock *cache_acquire(ByteCache *c, uint64_t shard, int kind, uint64_t block, int *mine);
void cache_complete(ByteCache *c, CachedBlock *b, char *data, size_t length);
/* As cache_complete, `capacity` bytes allocated at `data` (charged to the bound; at least
 * `length`, but for a sparse payload, whose `length` is how far it maps). */
void cache_complete_sized(ByteCache *c, CachedBlock *b, char *data, size_t length, size_t capacity);
/* The ready entry of at least `min_length` bytes held for reading, waiting for one being
 * filled, or growing short of `min_length` (*waited then 1); else a new entry being filled by
 * this worker (*mine 1), an older shorter one replaced (freed by its last reader). NULL: no
 * memory. */
CachedBlock *cache_acquire_min(ByteCache *c, uint64_t shard, int kind, uint64_t block, size_t min_length,
                               int *mine, int *waited);
/* `data` (`length` bytes, malloc'd) kept as the ready entry (shard, kind, block) if there is
 * none, or in place of a shorter ready one (freed by its last reader); else freed. */
void cache_put(ByteCache *c, uint64_t shard, int kind, uint64_t block, char *data, size_t length);
/* A buffer of at least `size` bytes (*capacity: its size) from the pool, or malloc'd; NULL:
 * no memory. buffer_put gives it back to the pool (or frees it). */
char *buffer_get(ByteCache *c, size_t size, size_t *capacity);
void buffer_put(ByteCache *c, char *data, size_t capacity);
/* An entry being filled by this worker dropped (its waiters then fill it themselves). */
void cache_abandon(ByteCache *c, CachedBlock *b);
/* A reader less (the entry may be evicted once it has none). */
void cache_release(ByteCache *c, CachedBlock *b);
/* `bytes` of the bound reserved for a block's payload being made and served by this worker
 * (located.c): what no reader holds is evicted to make room, and while other workers' payloads
 * leave none within half the bound, this one waits; a payload larger than that waits for none
 * to be in flight, and goes alone. Waiters go in turn (first come, first served). Given back by
 * cache_unreserve. */
void cache_reserve(ByteCache *c, size_t bytes);
void cache_unreserve(ByteCache *c, size_t bytes);
/* As cache_complete_sized, for a payload whose `reserved` bytes are still reserved: charged
 * as reserved until cache_settle gives the reservation back and charges it as an entry. */
void cache_complete_reserved(ByteCache *c, CachedBlock *b, char *data, size_t length, size_t capacity);
/* As cache_complete_reserved, for a payload ready up to `length` whose filler goes on
 * decompressing into `data` past it (growing): it ends that with cache_grown or
 * cache_replace_grown, whatever happens. */
void cache_complete_growing(ByteCache *c, CachedBlock *b, char *data, size_t length, size_t capacity);
/* The growing payload `b` is done: ready up to `length` (at least what it was), growing no more. */
void cache_grown(ByteCache *c, CachedBlock *b, size_t length);
/* The growing payload `b` is done, and replaced by a sparse one (`data`, malloc'd: `capacity`
 * bytes that map `length` decompressed bytes), charged as an entry and held for reading by the
 * filler (cache_release), which is returned; `b` (held by its filler) is freed by its last
 * reader, its buffer back to the pool. NULL: no memory (nothing done, `b` still growing, `data`
 * still the caller's). */
CachedBlock *cache_replace_grown(ByteCache *c, CachedBlock *b, char *data, size_t length, size_t capacity);
void cache_settle(ByteCache *c, CachedBlock *b, size_t reserved);
/* Up to `bytes` of the bound lent to another cache of the same process (the control plane's
 * block cache keeps that much less of this one): the entries no one reads are evicted to make
 * room, and what the entries being read and the payloads in flight hold is not lent. Never
 * waits for room: what is granted may be less, down to 0 (the borrower keeps less). The
 * borrower gives it back with cache_repay. */
size_t cache_lend(ByteCache *c, size_t bytes);
void cache_repay(ByteCache *c, size_t bytes);

#endif
