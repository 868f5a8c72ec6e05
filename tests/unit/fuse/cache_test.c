/* The byte cache (atlasfs/fuse/native/cache.c) alone: no Python, no FUSE, no table.
 *
 * Built and run by tests/unit/fuse/test_native_cache_unit.py (gcc, and again under
 * -fsanitize=address,undefined). Each check prints one line naming what went wrong and the
 * program exits 1; it prints "ok N checks" and exits 0 when all hold.
 */
#define _GNU_SOURCE
#include "cache.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

static int failures, checks;

#define CHECK(cond, ...)                                          \
    do {                                                          \
        checks++;                                                 \
        if (!(cond)) {                                            \
            failures++;                                           \
            fprintf(stderr, "%s:%d: ", __func__, __LINE__);       \
            fprintf(stderr, __VA_ARGS__);                         \
            fputc('\n', stderr);                                  \
        }                                                         \
    } while (0)

static void pause_ms(int ms)
{
    struct timespec t = {ms / 1000, (long)(ms % 1000) * 1000000L};
    nanosleep(&t, NULL);
}

/* Whether (shard, kind, block) is cached: a peek (which makes it the most recently used, as any
 * read does) and its release. */
static int cached(ByteCache *c, uint64_t shard, int kind, uint64_t block)
{
    CachedBlock *b = cache_peek(c, shard, kind, block);
    int found = b != NULL;
    if (found)
        cache_release(c, b);
    return found;
}

static char *bytes_of(size_t n, char fill)
{
    char *data = malloc(n ? n : 1);
    if (data == NULL) {
        perror("malloc");
        exit(2);
    }
    memset(data, fill, n);
    return data;
}

static size_t locked_size(ByteCache *c, const size_t *field)
{
    size_t v;
    pthread_mutex_lock(&c->lock);
    v = *field;
    pthread_mutex_unlock(&c->lock);
    return v;
}

/* An entry's cost to the bound: its bytes and its bookkeeping (cache_put). */
#define COST(n) ((n) + sizeof(CachedBlock))

/* A miss is the caller's to fill; once filled, a hit gives the same bytes. */
static void test_fill_then_hit(void)
{
    ByteCache c;
    CachedBlock *b;
    int mine = -1;
    CHECK(cache_init(&c, 1 << 20) == 0, "cache_init failed");
    CHECK(cache_peek(&c, 1, KIND_FILES, 7) == NULL, "an empty cache has entry (1, 7)");
    CHECK(cache_wait(&c, 1, KIND_FILES, 7) == NULL, "an empty cache waits for entry (1, 7)");
    b = cache_acquire(&c, 1, KIND_FILES, 7, &mine);
    CHECK(b != NULL && mine == 1, "a miss is not the caller's to fill (mine %d)", mine);
    cache_complete(&c, b, bytes_of(100, 'x'), 100);
    cache_release(&c, b);
    b = cache_acquire(&c, 1, KIND_FILES, 7, &mine);
    CHECK(b != NULL && mine == 0 && b->length == 100 && b->data[99] == 'x', "the filled entry is not a hit");
    if (b != NULL)
        cache_release(&c, b);
    CHECK(cache_peek(&c, 1, KIND_PAYLOAD, 7) == NULL, "another kind's key hits");
    CHECK(cache_peek(&c, 2, KIND_FILES, 7) == NULL, "another shard's key hits");
    CHECK(locked_size(&c, &c.bytes) == COST(100), "charged %zu bytes, not %zu", c.bytes, COST(100));
    cache_free(&c);
}

/* Within its bound, the least recently used go first; an entry read again is kept. */
static void test_bound_and_lru(void)
{
    ByteCache c;
    CachedBlock *b;
    uint64_t i;
    size_t bound = 5 * COST(1000);
    CHECK(cache_init(&c, bound) == 0, "cache_init failed");
    for (i = 0; i < 5; i++)
        cache_put(&c, 0, KIND_FILES, i, bytes_of(1000, (char)i), 1000);
    CHECK(c.bytes == bound, "5 entries charged %zu, not %zu", c.bytes, bound);
    b = cache_peek(&c, 0, KIND_FILES, 0);  /* block 0 used again: block 1 is now the oldest */
    CHECK(b != NULL, "block 0 was evicted within the bound");
    if (b != NULL)
        cache_release(&c, b);
    cache_put(&c, 0, KIND_FILES, 5, bytes_of(1000, 5), 1000);
    CHECK(c.bytes <= bound, "past the bound: %zu > %zu", c.bytes, bound);
    b = cache_peek(&c, 0, KIND_FILES, 1);
    CHECK(b == NULL, "block 1, the least recently used, was kept");
    if (b != NULL)
        cache_release(&c, b);
    for (i = 0; i < 6; i++) {
        if (i == 1)
            continue;
        b = cache_peek(&c, 0, KIND_FILES, i);
        CHECK(b != NULL && b->length == 1000 && b->data[0] == (char)i, "block %d was evicted or changed", (int)i);
        if (b != NULL)
            cache_release(&c, b);
    }
    cache_free(&c);
}

/* An entry being read is never evicted, even past the bound; it goes once let go of. */
static void test_read_entries_stay(void)
{
    ByteCache c;
    CachedBlock *held, *b;
    uint64_t i;
    size_t bound = 2 * COST(1000);
    CHECK(cache_init(&c, bound) == 0, "cache_init failed");
    cache_put(&c, 0, KIND_FILES, 0, bytes_of(1000, 'a'), 1000);
    held = cache_peek(&c, 0, KIND_FILES, 0);
    CHECK(held != NULL, "block 0 is not there");
    for (i = 1; i < 6; i++)
        cache_put(&c, 0, KIND_FILES, i, bytes_of(1000, 'b'), 1000);
    CHECK(held != NULL && held->data[999] == 'a', "a held entry's bytes changed");
    b = cache_peek(&c, 0, KIND_FILES, 0);
    CHECK(b == held, "a held entry was evicted");
    if (b != NULL)
        cache_release(&c, b);
    CHECK(c.bytes <= bound, "past the bound with one entry held: %zu > %zu", c.bytes, bound);
    if (held != NULL)
        cache_release(&c, held);
    cache_put(&c, 0, KIND_FILES, 6, bytes_of(1000, 'c'), 1000);
    cache_put(&c, 0, KIND_FILES, 7, bytes_of(1000, 'c'), 1000);
    CHECK(!cached(&c, 0, KIND_FILES, 0), "an entry let go of outlived newer ones past the bound");
    cache_free(&c);
}

/* Files kept for their next pieces (KIND_RUN) go first, frames' maps last. */
static void test_eviction_order(void)
{
    ByteCache c;
    size_t bound = 3 * COST(1000);
    CHECK(cache_init(&c, bound) == 0, "cache_init failed");
    cache_put(&c, 0, KIND_FRAME, 0, bytes_of(1000, 'm'), 1000);  /* oldest */
    cache_put(&c, 0, KIND_FILES, 1, bytes_of(1000, 'f'), 1000);
    cache_put(&c, 0, KIND_RUN, 2, bytes_of(1000, 'r'), 1000);    /* newest */
    cache_put(&c, 0, KIND_FILES, 3, bytes_of(1000, 'f'), 1000);
    CHECK(!cached(&c, 0, KIND_RUN, 2), "a file kept for its next pieces outlived older entries");
    cache_put(&c, 0, KIND_FILES, 4, bytes_of(1000, 'f'), 1000);
    CHECK(cached(&c, 0, KIND_FRAME, 0), "a frame's map went before other entries");
    CHECK(!cached(&c, 0, KIND_FILES, 1), "the oldest block's files outlived the map");
    cache_free(&c);
}

/* A longer entry put in place of a shorter one replaces it; a shorter one is dropped. */
static void test_put_keeps_the_longer(void)
{
    ByteCache c;
    CachedBlock *b;
    CHECK(cache_init(&c, 1 << 20) == 0, "cache_init failed");
    cache_put(&c, 0, KIND_FRAME, 0, bytes_of(10, 'a'), 10);
    cache_put(&c, 0, KIND_FRAME, 0, bytes_of(20, 'b'), 20);
    cache_put(&c, 0, KIND_FRAME, 0, bytes_of(5, 'c'), 5);
    b = cache_peek(&c, 0, KIND_FRAME, 0);
    CHECK(b != NULL && b->length == 20 && b->data[0] == 'b', "not the longest entry put");
    if (b != NULL)
        cache_release(&c, b);
    CHECK(c.bytes == COST(20), "charged %zu, not one entry of 20 bytes", c.bytes);
    cache_free(&c);
}

/* Single flight: of workers missing one entry at once, one fills it; the others wait and read it. */
#define FLIGHT_THREADS 8

typedef struct {
    ByteCache *c;
    int fills, hits, bad;
    pthread_mutex_t lock;
} Flight;

static void *flight_worker(void *arg)
{
    Flight *f = arg;
    int mine = 0;
    CachedBlock *b = cache_acquire(f->c, 3, KIND_PAYLOAD, 9, &mine);
    if (b == NULL)
        return NULL;
    if (mine) {
        pause_ms(50);  /* a slow fill: the others arrive meanwhile */
        cache_complete(f->c, b, bytes_of(4096, 'p'), 4096);
    }
    pthread_mutex_lock(&f->lock);
    if (mine)
        f->fills++;
    else
        f->hits++;
    if (b->state != READY || b->length != 4096 || b->data[4095] != 'p')
        f->bad++;
    pthread_mutex_unlock(&f->lock);
    cache_release(f->c, b);
    return NULL;
}

static void test_single_flight(void)
{
    ByteCache c;
    Flight f = {&c, 0, 0, 0, PTHREAD_MUTEX_INITIALIZER};
    pthread_t t[FLIGHT_THREADS];
    int i;
    CHECK(cache_init(&c, 1 << 20) == 0, "cache_init failed");
    for (i = 0; i < FLIGHT_THREADS; i++)
        pthread_create(&t[i], NULL, flight_worker, &f);
    for (i = 0; i < FLIGHT_THREADS; i++)
        pthread_join(t[i], NULL);
    CHECK(f.fills == 1, "%d workers filled the same entry", f.fills);
    CHECK(f.hits == FLIGHT_THREADS - 1, "%d workers read it, not %d", f.hits, FLIGHT_THREADS - 1);
    CHECK(f.bad == 0, "%d workers read it before it was filled", f.bad);
    cache_free(&c);
}

/* An entry abandoned by its filler is filled by a worker that waited for it. */
static void *abandoned_waiter(void *arg)
{
    ByteCache *c = arg;
    int mine = 0;
    CachedBlock *b = cache_acquire(c, 0, KIND_FILES, 1, &mine);
    if (b != NULL && mine)
        cache_complete(c, b, bytes_of(8, 'w'), 8);
    if (b != NULL)
        cache_release(c, b);
    return (void *)(intptr_t)mine;
}

static void test_abandoned_entry_is_filled_by_a_waiter(void)
{
    ByteCache c;
    CachedBlock *b, *got;
    pthread_t t;
    void *mine = NULL;
    int me = 0;
    CHECK(cache_init(&c, 1 << 20) == 0, "cache_init failed");
    b = cache_acquire(&c, 0, KIND_FILES, 1, &me);
    CHECK(b != NULL && me, "a miss is not the caller's");
    pthread_create(&t, NULL, abandoned_waiter, &c);
    pause_ms(30);
    if (b != NULL)
        cache_abandon(&c, b);
    pthread_join(t, &mine);
    CHECK(mine == (void *)1, "the waiter did not fill the abandoned entry");
    got = cache_peek(&c, 0, KIND_FILES, 1);
    CHECK(got != NULL && got->data[0] == 'w', "the waiter's bytes are not there");
    if (got != NULL)
        cache_release(&c, got);
    cache_free(&c);
}

/* cache_reserve serves its waiters in turn: a large reservation waiting for the cache to have
 * none in flight is not overtaken by smaller ones arriving after it, though they would fit
 * beside what is in flight; these then go one at a time (two do not fit half the bound), in
 * the order they came. */
typedef struct {
    ByteCache *c;
    size_t bytes;
    int *order, *served;
    pthread_mutex_t *lock;
    int name;
} Reserver;

static void *reserver(void *arg)
{
    Reserver *r = arg;
    cache_reserve(r->c, r->bytes);
    pthread_mutex_lock(r->lock);
    r->order[(*r->served)++] = r->name;
    pthread_mutex_unlock(r->lock);
    pause_ms(20);  /* held a while: one arriving later must wait for it */
    cache_unreserve(r->c, r->bytes);
    return NULL;
}

static void wait_for_tickets(ByteCache *c, uint64_t n)
{
    int i;
    for (i = 0; i < 2000; i++) {
        uint64_t next;
        pthread_mutex_lock(&c->lock);
        next = c->reserve_next;
        pthread_mutex_unlock(&c->lock);
        if (next >= n)
            return;
        pause_ms(1);
    }
}

#define SMALL_RESERVERS 4

static void test_reservations_in_turn(void)
{
    ByteCache c;
    pthread_mutex_t lock = PTHREAD_MUTEX_INITIALIZER;
    int order[1 + SMALL_RESERVERS], served = 0, i;
    Reserver r[1 + SMALL_RESERVERS];
    pthread_t t[1 + SMALL_RESERVERS];
    size_t bound = 1000;
    CHECK(cache_init(&c, bound) == 0, "cache_init failed");
    cache_reserve(&c, 150);  /* in flight: the large one below must wait for it */
    for (i = 0; i <= SMALL_RESERVERS; i++) {
        r[i] = (Reserver){&c, i == 0 ? 600 : 300, order, &served, &lock, i};
        pthread_create(&t[i], NULL, reserver, &r[i]);
        wait_for_tickets(&c, (uint64_t)i + 2);  /* each takes its ticket before the next starts */
    }
    pause_ms(50);
    pthread_mutex_lock(&lock);
    CHECK(served == 0, "%d reservations went past the large one waiting its turn", served);
    pthread_mutex_unlock(&lock);
    CHECK(locked_size(&c, &c.flight) == 150, "%zu bytes in flight, not 150", c.flight);
    cache_unreserve(&c, 150);
    for (i = 0; i <= SMALL_RESERVERS; i++)
        pthread_join(t[i], NULL);
    CHECK(served == 1 + SMALL_RESERVERS, "%d of %d reservations served", served, 1 + SMALL_RESERVERS);
    for (i = 0; i < served; i++)
        CHECK(order[i] == i, "reservation %d was served %dth (first come, first served)", order[i], i + 1);
    CHECK(c.flight == 0, "%zu bytes still in flight", c.flight);
    cache_free(&c);
}

/* Reserved bytes count against the bound: entries no one reads are evicted to make room. */
static void test_reserve_evicts(void)
{
    ByteCache c;
    size_t bound = 4 * COST(1000);
    CHECK(cache_init(&c, bound) == 0, "cache_init failed");
    cache_put(&c, 0, KIND_FILES, 0, bytes_of(1000, 'a'), 1000);
    cache_put(&c, 0, KIND_FILES, 1, bytes_of(1000, 'a'), 1000);
    cache_put(&c, 0, KIND_FILES, 2, bytes_of(1000, 'a'), 1000);
    cache_reserve(&c, 2 * COST(1000));
    CHECK(c.bytes + c.flight <= bound, "entries and reservation past the bound: %zu + %zu > %zu", c.bytes,
          c.flight, bound);
    CHECK(!cached(&c, 0, KIND_FILES, 0), "the oldest entry was not evicted for the reservation");
    CHECK(cached(&c, 0, KIND_FILES, 2), "the newest entry was evicted");
    cache_unreserve(&c, 2 * COST(1000));
    cache_free(&c);
}

/* The buffer pool gives back a buffer at most twice the size asked, never a smaller one. */
static void test_buffer_pool(void)
{
    ByteCache c;
    size_t cap = 0, cap2 = 0;
    char *a, *b;
    CHECK(cache_init(&c, 64 << 20) == 0, "cache_init failed");
    a = buffer_get(&c, 1 << 20, &cap);
    CHECK(a != NULL && cap >= (1 << 20), "a buffer of %zu bytes for 1 MiB", cap);
    if (a != NULL)
        memset(a, 1, 1 << 20);
    buffer_put(&c, a, cap);
    b = buffer_get(&c, 700 << 10, &cap2);
    CHECK(b == a && cap2 == cap, "the pooled buffer was not taken for a request within half its size");
    buffer_put(&c, b, cap2);
    b = buffer_get(&c, 100 << 10, &cap2);
    CHECK(b != a, "a pooled buffer ten times too large was taken");
    free(b);
    b = buffer_get(&c, 2 << 20, &cap2);
    CHECK(b != a && cap2 >= (2 << 20), "a buffer smaller than asked was given");
    free(b);
    cache_free(&c);
}

/* Lending (cache_lend): entries no one reads are evicted to make room for what is lent, an
 * entry being read and the payloads in flight are never lent, a loan never waits, the bound
 * shrinks by what is lent and grows back when repaid, and the peak counts what is lent. */
static void test_lend(void)
{
    ByteCache c;
    CachedBlock *held;
    size_t bound = 8 * COST(1000), granted, i;
    CHECK(cache_init(&c, bound) == 0, "cache_init failed");
    for (i = 0; i < 6; i++)
        cache_put(&c, 0, KIND_FILES, i, bytes_of(1000, 'a'), 1000);
    held = cache_peek(&c, 0, KIND_FILES, 5);  /* read now: never evicted for a loan */
    CHECK(held != NULL, "entry 5 is not in the cache");
    granted = cache_lend(&c, 4 * COST(1000));
    CHECK(granted == 4 * COST(1000), "lent %zu bytes with room made by evicting, not %zu", granted, 4 * COST(1000));
    CHECK(c.bound == bound - granted && c.bytes <= c.bound, "bound %zu, entries %zu after lending %zu of %zu",
          c.bound, c.bytes, granted, bound);
    CHECK(cache_peek(&c, 0, KIND_FILES, 0) == NULL, "the least recently used entry stayed beside the loan");
    cache_reserve(&c, COST(1000));  /* a payload in flight holds its bytes: not lent */
    granted = cache_lend(&c, bound);  /* more than is left: what can be, at once, without waiting */
    CHECK(granted == bound - 4 * COST(1000) - COST(1000) - COST(1000),
          "lent %zu of what is left beside the entry read and the payload in flight", granted);
    CHECK(held->length == 1000 && held->data[999] == 'a', "the entry being read was evicted");
    CHECK(c.bytes + c.flight + c.lent <= bound, "entries %zu, in flight %zu and lent %zu past the bound %zu",
          c.bytes, c.flight, c.lent, bound);
    CHECK(cache_lend(&c, 1) == 0, "lent past the bound");
    cache_release(&c, held);
    cache_unreserve(&c, COST(1000));
    cache_repay(&c, c.lent);
    CHECK(c.lent == 0 && c.bound == bound, "repaid: bound %zu of %zu, %zu still lent", c.bound, bound, c.lent);
    cache_put(&c, 0, KIND_FILES, 9, bytes_of(7 * 1000, 'b'), 7 * 1000);
    held = cache_peek(&c, 0, KIND_FILES, 9);
    CHECK(held != NULL, "an entry of most of the bound, once repaid, is not kept");
    if (held != NULL)
        cache_release(&c, held);
    CHECK(c.peak <= bound && c.peak >= bound - COST(1000), "peak %zu of a bound of %zu held whole", c.peak, bound);
    cache_free(&c);
}

/* A payload published ready up to part of it while its filler makes the rest (growing): a
 * reader needing no more than what is ready reads it at once; one needing more waits for the
 * rest, then reads it whole (made in place: cache_grown), or the sparse entry that replaced it
 * (cache_replace_grown), the growing one freed by its last reader; charged as one entry. */
typedef struct {
    ByteCache *c;
    size_t need;
    int done, waited;
    CachedBlock *got;
    size_t length;
} GrowWaiter;

static void *grow_waiter(void *arg)
{
    GrowWaiter *w = arg;
    int mine = 0, waited = 0;
    CachedBlock *b = cache_acquire_min(w->c, 1, KIND_PAYLOAD, 2, w->need, &mine, &waited);
    pthread_mutex_lock(&w->c->lock);
    w->got = b;
    w->waited = waited;
    w->length = b != NULL && !mine ? b->length : 0;
    w->done = 1;
    pthread_mutex_unlock(&w->c->lock);
    if (b != NULL)
        cache_release(w->c, b);
    return NULL;
}

static void test_growing(int replace)
{
    ByteCache c;
    CachedBlock *b, *early;
    GrowWaiter w;
    pthread_t t;
    char *data;
    size_t capacity;
    int mine = 0, waited = 0;
    CHECK(cache_init(&c, 1 << 20) == 0, "cache_init failed");
    w = (GrowWaiter){&c, 800, 0, 0, NULL, 0};
    b = cache_acquire_min(&c, 1, KIND_PAYLOAD, 2, 100, &mine, &waited);
    CHECK(b != NULL && mine, "a miss is not the caller's");
    if (b == NULL)
        return;
    cache_reserve(&c, 1000);
    data = buffer_get(&c, 1000, &capacity);
    memset(data, 'g', 1000);
    cache_complete_growing(&c, b, data, 200, capacity);
    /* ready as far as 200 bytes: a reader of 150 reads it now, without waiting */
    early = cache_acquire_min(&c, 1, KIND_PAYLOAD, 2, 150, &mine, &waited);
    CHECK(early == b && !mine && !waited, "a reader of what is ready waited, or made its own");
    pthread_create(&t, NULL, grow_waiter, &w);
    for (;;) {  /* until the waiter waits (however late a loaded machine runs it) */
        size_t waiting;
        pthread_mutex_lock(&c.lock);
        waiting = c.waiting;
        CHECK(!w.done, "a reader of more than is ready did not wait");
        pthread_mutex_unlock(&c.lock);
        if (waiting == 1 || w.done)
            break;
        pause_ms(1);
    }
    if (replace) {
        CachedBlock *sparse = cache_replace_grown(&c, b, bytes_of(300, 's'), 1000, 300);
        CHECK(sparse != NULL && sparse != b && sparse->sparse && sparse->readers == 1, "no replacement held");
        pthread_join(t, NULL);
        if (sparse != NULL)
            cache_release(&c, sparse);
        CHECK(w.got != NULL && w.got != b && w.length == 1000 && w.waited, "the waiter did not read the sparse one");
        cache_release(&c, b);  /* the filler */
        if (early != NULL)
            cache_release(&c, early);  /* the last reader of the growing one: freed now (ASan) */
        cache_unreserve(&c, 1000);
        CHECK(c.bytes == 300 + sizeof(CachedBlock), "charged %zu, not the sparse entry alone", c.bytes);
    } else {
        cache_grown(&c, b, 1000);
        pthread_join(t, NULL);
        CHECK(w.got == b && w.length == 1000 && w.waited, "the waiter did not read it made whole");
        if (early != NULL)
            cache_release(&c, early);
        cache_settle(&c, b, 1000);
        cache_release(&c, b);
        CHECK(c.bytes == capacity + sizeof(CachedBlock), "charged %zu, not one entry of %zu", c.bytes, capacity);
    }
    CHECK(c.flight == 0, "%zu bytes still reserved", c.flight);
    cache_free(&c);
}

int main(void)
{
    test_fill_then_hit();
    test_bound_and_lru();
    test_read_entries_stay();
    test_eviction_order();
    test_put_keeps_the_longer();
    test_single_flight();
    test_abandoned_entry_is_filled_by_a_waiter();
    test_reservations_in_turn();
    test_reserve_evicts();
    test_buffer_pool();
    test_lend();
    test_growing(0);
    test_growing(1);
    if (failures) {
        fprintf(stderr, "%d of %d checks failed\n", failures, checks);
        return 1;
    }
    printf("ok %d checks\n", checks);
    return 0;
}
