/* The decoded-block cache on local disk (`atlasfs mount --decoded-cache DIR`, issue #39): a
 * block's zstd frame, once decompressed whole by located.c, is written to a file of its own in
 * DIR, and later reads of the block's files `pread` from it instead of decompressing the frame
 * again: the kernel's page cache, not the daemon's heap, holds its hot pages, and a later
 * mount of the same dataset finds it there too.
 *
 * Safety (docs/reliability.md): DIR is the mounting user's (checked by the control plane, and
 * again here on the descriptor opened O_DIRECTORY | O_NOFOLLOW: a folder owned by this user,
 * writable by no one else); every later call goes through that descriptor (openat, renameat,
 * unlinkat), never the path. A file is written under a temporary name (O_CREAT | O_EXCL |
 * O_NOFOLLOW) and renamed once whole. It is named `<key>-<block>.blk`, the key a hash of the
 * dataset's identity (the one its stored tables are kept under), the shard's data.bin
 * (resolved path, size, mtime) and its index.npy: two datasets, or a shard rewritten, never
 * share a file. A file is opened O_NOFOLLOW | O_NONBLOCK and used only if it is a regular file
 * of this user of the size written; the caller checks the CRC-32 of every run read from it
 * (located.c), and a file that fails is removed and its block decompressed again: a corrupt or
 * truncated file is never served. Files of other names in DIR are never touched.
 *
 * Bound: the files' sizes in all, least recently used block first (an LRU list in memory, the
 * files deleted). At start the files already in DIR count toward the bound, the least recently
 * written first to go; a temporary file older than an hour (a writer that died) is removed.
 */
#include "engine.h"

#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#define DISK_BUCKETS 4096
#define TMP_PREFIX ".tmp-"
#define SUFFIX ".blk"
/* A temporary file this old was left by a writer that died. */
#define STALE_TMP_SECONDS 3600

enum { DISK_WRITING, DISK_READY };

typedef struct DiskEntry DiskEntry;
struct DiskEntry {
    uint64_t key, block, size;
    int64_t written;  /* when written (s since the epoch): the order at start */
    int state;
    DiskEntry *prev, *next;  /* LRU, most recently used first */
    DiskEntry *hnext;
};

struct DiskBlocks {
    int dirfd;
    uint64_t bound, total;
    char identity[80];
    pthread_mutex_t lock;
    DiskEntry *head, *tail, *buckets[DISK_BUCKETS];
    uint64_t tmp_counter;
    /* Counters (Session.decoded()). */
    uint64_t hits, misses, written, write_failed, bad, evicted, found, ignored;
};

static size_t bucket(uint64_t key, uint64_t block)
{
    return (size_t)(((key ^ (block * UINT64_C(0x9E3779B97F4A7C15))) * UINT64_C(0xC2B2AE3D27D4EB4F)) >> 52)
           & (DISK_BUCKETS - 1);
}

static void name_of(uint64_t key, uint64_t block, char *out, size_t size)
{
    snprintf(out, size, "%016llx-%llu" SUFFIX, (unsigned long long)key, (unsigned long long)block);
}

/* Lock held, for all below. */
static DiskEntry *find(DiskBlocks *d, uint64_t key, uint64_t block)
{
    DiskEntry *e;
    for (e = d->buckets[bucket(key, block)]; e != NULL; e = e->hnext)
        if (e->key == key && e->block == block)
            return e;
    return NULL;
}

static void lru_unlink(DiskBlocks *d, DiskEntry *e)
{
    if (e->prev != NULL)
        e->prev->next = e->next;
    else
        d->head = e->next;
    if (e->next != NULL)
        e->next->prev = e->prev;
    else
        d->tail = e->prev;
    e->prev = e->next = NULL;
}

static void lru_front(DiskBlocks *d, DiskEntry *e)
{
    e->prev = NULL;
    e->next = d->head;
    if (d->head != NULL)
        d->head->prev = e;
    else
        d->tail = e;
    d->head = e;
}

/* Into the table and the LRU list: at the front, or with `oldest`, at the back. */
static void insert(DiskBlocks *d, DiskEntry *e, int oldest)
{
    DiskEntry **head = &d->buckets[bucket(e->key, e->block)];
    e->hnext = *head;
    *head = e;
    if (!oldest) {
        lru_front(d, e);
        return;
    }
    e->next = NULL;
    e->prev = d->tail;
    if (d->tail != NULL)
        d->tail->next = e;
    else
        d->head = e;
    d->tail = e;
}

/* Out of the table and the list, its bytes uncounted, freed. */
static void remove_entry(DiskBlocks *d, DiskEntry *e)
{
    DiskEntry **at = &d->buckets[bucket(e->key, e->block)];
    while (*at != NULL && *at != e)
        at = &(*at)->hnext;
    if (*at == e)
        *at = e->hnext;
    lru_unlink(d, e);
    d->total -= e->size < d->total ? e->size : d->total;
    free(e);
}

/* The least recently used ready entries removed until `room` more bytes fit the bound; their
 * files' names appended to `names` (*n of them; unlinked by the caller, the lock released).
 * 1 if the room is there, else 0 (only files being written are left). */
static int make_room(DiskBlocks *d, uint64_t room, char (**names)[48], size_t *n)
{
    DiskEntry *e = d->tail;
    while (d->total + room > d->bound && e != NULL) {
        DiskEntry *prev = e->prev;
        if (e->state == DISK_READY) {
            char (*grown)[48] = realloc(*names, (*n + 1) * sizeof **names);
            if (grown == NULL)
                return 0;
            *names = grown;
            name_of(e->key, e->block, (*names)[(*n)++], sizeof **names);
            remove_entry(d, e);
            d->evicted++;
        }
        e = prev;
    }
    return d->total + room <= d->bound;
}

static void unlink_names(DiskBlocks *d, char (*names)[48], size_t n)
{
    size_t i;
    for (i = 0; i < n; i++)
        unlinkat(d->dirfd, names[i], 0);
    free(names);
}

/* FNV-1a over `size` bytes, on from `h`. */
static uint64_t fnv(uint64_t h, const void *data, size_t size)
{
    const unsigned char *p = data;
    size_t i;
    for (i = 0; i < size; i++) {
        h ^= p[i];
        h *= UINT64_C(0x100000001B3);
    }
    return h;
}

uint64_t diskblocks_key(const Session *s, const char *data_path, const int64_t sig[4])
{
    const DiskBlocks *d = s->disk;
    char *resolved;
    uint64_t h = UINT64_C(0xCBF29CE484222325);
    unsigned char le[8];
    int i, j;
    if (d == NULL)
        return 0;
    resolved = realpath(data_path, NULL);
    h = fnv(h, d->identity, strlen(d->identity) + 1);
    h = fnv(h, resolved ? resolved : data_path, strlen(resolved ? resolved : data_path) + 1);
    free(resolved);
    for (i = 0; i < 4; i++) {
        for (j = 0; j < 8; j++)
            le[j] = (unsigned char)((uint64_t)sig[i] >> (8 * j));
        h = fnv(h, le, sizeof le);
    }
    /* splitmix64's finalizer: every input bit reaches every output bit */
    h ^= h >> 30;
    h *= UINT64_C(0xBF58476D1CE4E5B9);
    h ^= h >> 27;
    h *= UINT64_C(0x94D049BB133111EB);
    h ^= h >> 31;
    return h ? h : 1;  /* 0 means none */
}

int diskblocks_has(Session *s, uint64_t key, uint64_t block)
{
    DiskBlocks *d = s->disk;
    DiskEntry *e;
    int ready;
    if (d == NULL || key == 0)
        return 0;
    pthread_mutex_lock(&d->lock);
    e = find(d, key, block);
    ready = e != NULL && e->state == DISK_READY;
    pthread_mutex_unlock(&d->lock);
    return ready;
}

int diskblocks_fits(const Session *s, uint64_t size)
{
    /* A block of more than a quarter of the bound would push out a quarter of the rest. */
    return s->disk != NULL && size > 0 && size <= s->disk->bound / 4;
}

static void forget(DiskBlocks *d, uint64_t key, uint64_t block, int bad);

int diskblocks_read(Session *s, uint64_t key, uint64_t block, uint64_t at, size_t size, char *out)
{
    DiskBlocks *d = s->disk;
    DiskEntry *e;
    uint64_t expected;
    char name[48];
    struct stat st;
    int fd, ok = 0;
    if (d == NULL || key == 0)
        return 1;
    pthread_mutex_lock(&d->lock);
    e = find(d, key, block);
    if (e == NULL || e->state != DISK_READY) {
        d->misses++;
        pthread_mutex_unlock(&d->lock);
        return 1;
    }
    lru_unlink(d, e);
    lru_front(d, e);
    expected = e->size;
    pthread_mutex_unlock(&d->lock);
    name_of(key, block, name, sizeof name);
    fd = openat(d->dirfd, name, O_RDONLY | O_NOFOLLOW | O_NONBLOCK | O_CLOEXEC);
    if (fd < 0 && errno == ENOENT) {  /* removed meanwhile (evicted, another mount, the user): a miss */
        forget(d, key, block, 0);
        return 1;
    }
    if (fd >= 0) {
        /* Only this user's regular file of the size written (a truncated one is caught here,
         * a corrupt one by the caller's CRC-32), and only bytes within it. */
        ok = fstat(fd, &st) == 0 && S_ISREG(st.st_mode) && st.st_uid == geteuid() && (uint64_t)st.st_size == expected
             && at <= expected && size <= expected - at && read_full(fd, out, size, at) == 0;
        close(fd);
    }
    if (!ok) {
        diskblocks_drop(s, key, block);
        return -1;
    }
    __atomic_add_fetch(&d->hits, 1, __ATOMIC_RELAXED);
    return 0;
}

/* The ready entry of the block forgotten and its file removed (a file written again meanwhile
 * too: never one the bound does not count); with `bad`, counted. */
static void forget(DiskBlocks *d, uint64_t key, uint64_t block, int bad)
{
    DiskEntry *e;
    char name[48];
    int gone = 0;
    pthread_mutex_lock(&d->lock);
    e = find(d, key, block);
    if (e != NULL && e->state == DISK_READY) {
        remove_entry(d, e);
        d->bad += bad;
        gone = 1;
    }
    pthread_mutex_unlock(&d->lock);
    if (gone) {
        name_of(key, block, name, sizeof name);
        unlinkat(d->dirfd, name, 0);
    }
}

void diskblocks_drop(Session *s, uint64_t key, uint64_t block)
{
    if (s->disk != NULL)
        forget(s->disk, key, block, 1);
}

/* All `size` bytes of `data` to `fd`: 0, or -1. */
static int write_all(int fd, const char *data, size_t size)
{
    while (size > 0) {
        ssize_t n = write(fd, data, size);
        if (n < 0 && errno == EINTR)
            continue;
        if (n <= 0)
            return -1;
        data += n;
        size -= (size_t)n;
    }
    return 0;
}

void diskblocks_write(Session *s, uint64_t key, uint64_t block, const char *data, size_t size)
{
    DiskBlocks *d = s->disk;
    DiskEntry *e;
    char (*victims)[48] = NULL;
    size_t nvictims = 0;
    char name[48], tmp[64];
    int fd, ok = 0;
    if (d == NULL || key == 0 || !diskblocks_fits(s, size))
        return;
    pthread_mutex_lock(&d->lock);
    if (find(d, key, block) != NULL || (e = calloc(1, sizeof *e)) == NULL) {
        pthread_mutex_unlock(&d->lock);
        return;  /* there, or being written: once */
    }
    if (!make_room(d, size, &victims, &nvictims)) {
        pthread_mutex_unlock(&d->lock);
        free(e);
        unlink_names(d, victims, nvictims);
        return;
    }
    e->key = key;
    e->block = block;
    e->size = size;
    e->state = DISK_WRITING;  /* counted from now: writers at once stay within the bound */
    insert(d, e, 0);
    d->total += size;
    snprintf(tmp, sizeof tmp, TMP_PREFIX "%d-%llu", (int)getpid(), (unsigned long long)++d->tmp_counter);
    pthread_mutex_unlock(&d->lock);
    unlink_names(d, victims, nvictims);
    name_of(key, block, name, sizeof name);
    fd = openat(d->dirfd, tmp, O_WRONLY | O_CREAT | O_EXCL | O_NOFOLLOW | O_CLOEXEC, 0600);
    if (fd >= 0) {
        ok = write_all(fd, data, size) == 0;
        ok = close(fd) == 0 && ok;
        ok = ok && renameat(d->dirfd, tmp, d->dirfd, name) == 0;
        if (!ok)
            unlinkat(d->dirfd, tmp, 0);
    }
    pthread_mutex_lock(&d->lock);
    if (ok) {
        e->state = DISK_READY;
        e->written = (int64_t)time(NULL);
        d->written++;
    } else {
        remove_entry(d, e);  /* a full disk, a read-only folder: the block is decompressed next time */
        d->write_failed++;
    }
    pthread_mutex_unlock(&d->lock);
}

/* `name` as `<16 hex>-<block>.blk`: 1 and its key and block, else 0. */
static int parse_name(const char *name, uint64_t *key, uint64_t *block)
{
    char *end;
    size_t len = strlen(name), i;
    if (len < 16 + 1 + 1 + sizeof SUFFIX - 1 || name[16] != '-' || strcmp(name + len - (sizeof SUFFIX - 1), SUFFIX) != 0)
        return 0;
    for (i = 0; i < 16; i++)
        if (!((name[i] >= '0' && name[i] <= '9') || (name[i] >= 'a' && name[i] <= 'f')))
            return 0;
    if (name[17] < '0' || name[17] > '9')
        return 0;
    errno = 0;
    *key = strtoull(name, &end, 16);
    if (end != name + 16)
        return 0;
    *block = strtoull(name + 17, &end, 10);
    return errno == 0 && end == name + len - (sizeof SUFFIX - 1) && *key != 0;
}

static int by_written(const void *a, const void *b)
{
    const DiskEntry *x = *(DiskEntry *const *)a, *y = *(DiskEntry *const *)b;
    return x->written < y->written ? 1 : x->written > y->written ? -1 : 0;  /* newest first */
}

/* The files already in the folder counted (newest first in the LRU list), stale temporary files
 * removed, anything else left alone. Then the oldest removed past the bound. GIL released. */
static void scan(DiskBlocks *d)
{
    int fd = dup(d->dirfd);
    DIR *dir = fd >= 0 ? fdopendir(fd) : NULL;
    struct dirent *ent;
    DiskEntry **found = NULL;
    size_t n = 0, room = 0, i;
    char (*victims)[48] = NULL;
    size_t nvictims = 0;
    time_t now = time(NULL);
    if (dir == NULL) {
        if (fd >= 0)
            close(fd);
        return;
    }
    while ((ent = readdir(dir)) != NULL) {
        struct stat st;
        uint64_t key, block;
        DiskEntry *e;
        if (strncmp(ent->d_name, TMP_PREFIX, sizeof TMP_PREFIX - 1) == 0) {
            if (fstatat(d->dirfd, ent->d_name, &st, AT_SYMLINK_NOFOLLOW) == 0 && S_ISREG(st.st_mode)
                && st.st_uid == geteuid() && st.st_mtime < now - STALE_TMP_SECONDS)
                unlinkat(d->dirfd, ent->d_name, 0);
            continue;
        }
        if (!parse_name(ent->d_name, &key, &block))
            continue;  /* not ours: never touched */
        /* A link, a FIFO, a folder or another user's file under a cache file's name: never
         * counted, opened or used (a read opens O_NOFOLLOW | O_NONBLOCK and checks again). */
        if (fstatat(d->dirfd, ent->d_name, &st, AT_SYMLINK_NOFOLLOW) != 0 || !S_ISREG(st.st_mode)
            || st.st_uid != geteuid()) {
            d->ignored++;
            continue;
        }
        if (n == room) {
            DiskEntry **grown = realloc(found, (room ? 2 * room : 256) * sizeof *found);
            if (grown == NULL)
                break;
            found = grown;
            room = room ? 2 * room : 256;
        }
        if ((e = calloc(1, sizeof *e)) == NULL)
            break;
        e->key = key;
        e->block = block;
        e->size = (uint64_t)st.st_size;
        e->written = (int64_t)st.st_mtime;
        e->state = DISK_READY;
        found[n++] = e;
    }
    closedir(dir);
    if (n > 0)
        qsort(found, n, sizeof *found, by_written);
    pthread_mutex_lock(&d->lock);
    for (i = 0; i < n; i++) {
        if (find(d, found[i]->key, found[i]->block) != NULL) {
            free(found[i]);
            continue;
        }
        insert(d, found[i], 1);  /* newest first, so each next one goes behind: oldest at the tail */
        d->total += found[i]->size;
        d->found++;
    }
    make_room(d, 0, &victims, &nvictims);
    pthread_mutex_unlock(&d->lock);
    free(found);
    unlink_names(d, victims, nvictims);
}

static void disk_free(DiskBlocks *d)
{
    DiskEntry *e, *next;
    if (d == NULL)
        return;
    for (e = d->head; e != NULL; e = next) {
        next = e->next;
        free(e);
    }
    if (d->dirfd >= 0)
        close(d->dirfd);
    pthread_mutex_destroy(&d->lock);
    free(d);
}

void diskblocks_free(Session *s)
{
    disk_free(s->disk);
    s->disk = NULL;
}

/* Session.decoded_cache(path, bound, identity) */
PyObject *diskblocks_configure(Session *self, PyObject *args)
{
    PyObject *path_obj;
    const char *identity;
    unsigned long long bound;
    DiskBlocks *d;
    struct stat st;
    int fd, err = 0;
    if (!PyArg_ParseTuple(args, "O&Ks", PyUnicode_FSConverter, &path_obj, &bound, &identity))
        return NULL;
    if (self->disk != NULL) {
        Py_DECREF(path_obj);
        PyErr_SetString(PyExc_RuntimeError, "the decoded cache is set up already");
        return NULL;
    }
    if (strlen(identity) >= sizeof d->identity || bound == 0) {
        Py_DECREF(path_obj);
        PyErr_SetString(PyExc_ValueError, "decoded cache: an identity of at most 79 bytes and a bound of 1 byte or more");
        return NULL;
    }
    Py_BEGIN_ALLOW_THREADS
    fd = open(PyBytes_AS_STRING(path_obj), O_RDONLY | O_DIRECTORY | O_NOFOLLOW | O_CLOEXEC);
    if (fd < 0 || fstat(fd, &st) != 0)
        err = errno;
    Py_END_ALLOW_THREADS
    if (err != 0 || fd < 0) {
        if (fd >= 0)
            close(fd);
        errno = err;
        PyErr_SetFromErrnoWithFilenameObject(PyExc_OSError, path_obj);
        Py_DECREF(path_obj);
        return NULL;
    }
    /* Checked again on the descriptor every later call goes through (the control plane checked
     * the path): this user's folder, writable by no one else. */
    if (st.st_uid != geteuid() || (st.st_mode & 022) != 0) {
        PyErr_Format(PyExc_ValueError, "%s: the decoded cache folder must be this user's and writable by no one else",
                     PyBytes_AS_STRING(path_obj));
        close(fd);
        Py_DECREF(path_obj);
        return NULL;
    }
    Py_DECREF(path_obj);
    if ((d = calloc(1, sizeof *d)) == NULL) {
        close(fd);
        return PyErr_NoMemory();
    }
    d->dirfd = fd;
    d->bound = bound;
    strcpy(d->identity, identity);
    if (pthread_mutex_init(&d->lock, NULL) != 0) {
        close(fd);
        free(d);
        PyErr_SetString(PyExc_RuntimeError, "decoded cache: no mutex");
        return NULL;
    }
    Py_BEGIN_ALLOW_THREADS
    scan(d);
    Py_END_ALLOW_THREADS
    self->disk = d;
    Py_RETURN_NONE;
}

/* Session.decoded() */
PyObject *diskblocks_stats(Session *self, PyObject *unused)
{
    DiskBlocks *d = self->disk;
    PyObject *out;
    (void)unused;
    if (d == NULL)
        Py_RETURN_NONE;
    pthread_mutex_lock(&d->lock);
    out = Py_BuildValue("{sKsKsKsKsKsKsKsKsKsK}", "hits", (unsigned long long)d->hits, "misses",
                        (unsigned long long)d->misses, "written", (unsigned long long)d->written, "write_failed",
                        (unsigned long long)d->write_failed, "bad", (unsigned long long)d->bad, "evicted",
                        (unsigned long long)d->evicted, "found", (unsigned long long)d->found, "ignored",
                        (unsigned long long)d->ignored, "bytes", (unsigned long long)d->total, "bound",
                        (unsigned long long)d->bound);
    pthread_mutex_unlock(&d->lock);
    return out;
}
