/* Atlas's located reads in C, beside the format they read (the engine, atlasfs/fuse/native,
 * calls them through located.h; they use of the engine only reader.h: its columns, byte
 * cache, counts and replies, no FUSE).
 *
 * A file whose block's files are not in the byte cache is served from
 * where its bytes lie in the block (the table's locators), without Python and without
 * unpickling, as atlasfs/formats/atlas/spans/read.py does in Python (read_span), with the
 * same checks:
 *
 * - a run: the block's decompressed bytes (its payload: the stored bytes of a block with no
 *   compression, else its one zstd frame decompressed, within max_block_bytes) are kept in
 *   the byte cache (KIND_PAYLOAD) for the block's other files; the file is the locator's
 *   prefix followed by the run at (offset, length) of the payload, and the CRC-32 of both
 *   must be the locator's check. Where the frame stores zstd blocks raw (incompressible bytes:
 *   JPEG), the payload keeps only what cannot be read from disk (a sparse payload: the
 *   frame's map and its compressed zstd blocks' bytes), and a run is assembled from preads of
 *   its raw pieces and copies of the kept ones, and checked at every read;
 * - an inline file (small, kept in the table): the block's fingerprint (its frame's content
 *   checksum, the last 4 stored bytes; else the CRC-32 of the block's stored bytes, read whole
 *   once and remembered while data.bin stays the same file) must tie it to the block it came
 *   from;
 * - a kept file (kept in the table too, compressed with its block's other kept files: one zstd
 *   frame a block): the frame is decompressed once, kept in the byte cache (KIND_KEPT), and
 *   the file, sliced from it, must be tied to its block as an inline file is.
 *
 * data.bin and index.npy are checked unchanged (size, mtime) since the dataset was opened
 * before every read. Anything that does not check out is left to the control plane, which
 * reads the same file its own way, says why where it fails, and serves or fails it (EIO):
 * located_read then answers 0, and the block is not tried here again.
 *
 * Everything the control plane attached is untrusted (a stored table may be another
 * user's): every locator, prefix number, offset and length is checked before it is used.
 */
#define ZSTD_STATIC_LINKING_ONLY /* the buffer-less streaming decoder: a frame block by block */
#include "located.h"

#include <errno.h>
#include <fcntl.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <sys/uio.h>
#include <time.h>
#include <unistd.h>
#include <zlib.h>
#include <zstd.h>

/* Blocks with no frame checksum (strategy 0) are fingerprinted by the CRC-32 of their stored
 * bytes (spans/find.py block_fingerprint), read in pieces of this many bytes once a block and
 * remembered, by spans/fingerprints.py's rules: with a token of data.bin's identity (device,
 * inode, size, mtime, ctime: a write, or setting the mtime back, changes the ctime), used
 * only while that holds, and never when data.bin changed less than RACY_S seconds before the
 * read (a change within the same tick of the file system's coarse clock keeps its ctime). */
#define FINGERPRINT_PIECE (1 << 20)

struct Located {
    Column offset, length, check, prefix, inline_bytes, kept;  /* buffers, or ranges of the table's file */
    Py_buffer prefix_ends, prefixes, kept_ends;
    uint64_t rows, nprefixes, nkept;  /* nkept: blocks with an end in kept_ends */
    int fd;
    char *data_path, *index_path;
    int64_t data_size, data_mtime_ns, index_size, index_mtime_ns;
    uint64_t *starts;  /* nblocks + 1, ascending: block b is starts[b] .. starts[b + 1] of data.bin */
    uint64_t nblocks, max_block_bytes;
    int compressed;
    SharedDict *dictionary;  /* shared with the shards that have the same one; NULL: none */
    uint8_t *unlocated;  /* one byte a block: a located read of it failed here */
    uint64_t disk_key;   /* its blocks' files in the decoded cache (diskblocks.c); 0: none */
    Session *session;    /* whose located_stored counts data_size, once attached */
    /* nblocks (8 bytes a block, as starts), made at the first fingerprint remembered: block b's
     * is identity << 32 | CRC-32 of its stored bytes; 0: none */
    uint64_t *fingerprints;
};

/* One row's locator, resolved and checked against the buffers. */
typedef struct {
    const char *prefix;
    char inline_bytes[INLINE_MAX + 1];  /* an inline file's, copied (layout.h) */
    size_t prefix_len;
    uint64_t offset, length;
    uint32_t check;
    int is_inline, is_kept;
} Span;

void located_free(Located *l)
{
    Column *columns[6];
    Py_buffer *buffers[3];
    size_t i;
    if (l == NULL)
        return;
    columns[0] = &l->offset;
    columns[1] = &l->length;
    columns[2] = &l->check;
    columns[3] = &l->prefix;
    columns[4] = &l->inline_bytes;
    columns[5] = &l->kept;
    buffers[0] = &l->prefix_ends;
    buffers[1] = &l->prefixes;
    buffers[2] = &l->kept_ends;
    for (i = 0; i < sizeof columns / sizeof *columns; i++)
        column_release(columns[i]);
    for (i = 0; i < sizeof buffers / sizeof *buffers; i++)
        if (buffers[i]->obj != NULL)
            PyBuffer_Release(buffers[i]);
    if (l->session != NULL)
        __atomic_sub_fetch(&engine_counters(l->session)->located_stored, (uint64_t)l->data_size, __ATOMIC_RELAXED);
    if (l->fd >= 0)
        close(l->fd);
    dictionary_drop(l->dictionary);
    free(l->data_path);
    free(l->index_path);
    free(l->starts);
    free(l->unlocated);
    free(l->fingerprints);
    free(l);
}

static int buffer(PyObject *obj, Py_buffer *view)
{
    return PyObject_GetBuffer(obj, view, PyBUF_C_CONTIGUOUS);
}

/* `c` from `obj` (a buffer, or a range of the shard table's file), of `expected` bytes if that is >= 0. */
static int column(const ShardTable *t, PyObject *obj, Column *c, int64_t expected, const char *what)
{
    if (engine_table_column(t, obj, c, what) != 0)
        return -1;
    if (expected >= 0 && c->len != (uint64_t)expected) {
        PyErr_Format(PyExc_ValueError, "locate: %s has %llu bytes, not %lld", what, (unsigned long long)c->len,
                     (long long)expected);
        return -1;
    }
    return 0;
}

/* locate(shard, offset, length, check, prefix, prefix_ends, prefixes, inline, kept, kept_ends,
 *        data_path, index_path, signatures=(data_size, data_mtime_ns, index_size, index_mtime_ns),
 *        starts, compressed, dictionary (or None), max_block_bytes, data_identity=(st_dev, st_ino)):
 *        called with keywords (twenty-one values, most of them buffers, which no type check would
 *        tell apart in the wrong order). */
PyObject *located_attach(Session *self, PyObject *args, PyObject *kwds)
{
    static char *kwlist[] = {
        "shard", "offset", "length", "check", "prefix", "prefix_ends", "prefixes", "inline", "kept", "kept_ends",
        "data_path", "index_path", "signatures", "starts", "compressed", "dictionary", "max_block_bytes",
        "data_identity", NULL,
    };
    Py_ssize_t shard, nstarts, i;
    PyObject *offset, *length, *check, *prefix, *prefix_ends, *prefixes, *inline_bytes, *kept, *kept_ends, *starts;
    PyObject *dictionary;
    const char *data_path, *index_path;
    long long sig[4];
    unsigned long long max_block_bytes, identity[2];
    int compressed;
    Py_buffer view;
    Located *l;
    ShardTable *t;
    uint64_t generation;
    if (!PyArg_ParseTupleAndKeywords(args, kwds, "nOOOOOOOOOyy(LLLL)OpOK(KK):locate", kwlist, &shard, &offset,
                                     &length, &check, &prefix, &prefix_ends, &prefixes, &inline_bytes, &kept,
                                     &kept_ends, &data_path, &index_path, &sig[0], &sig[1], &sig[2], &sig[3],
                                     &starts, &compressed, &dictionary, &max_block_bytes, &identity[0],
                                     &identity[1]))
        return NULL;
    if ((t = engine_table(self, shard, "locate")) == NULL)
        return NULL;
    l = calloc(1, sizeof *l);
    if (l == NULL)
        return PyErr_NoMemory();
    l->fd = -1;
    l->offset.fd = l->length.fd = l->check.fd = l->prefix.fd = l->inline_bytes.fd = l->kept.fd = -1;
    /* attach() came first, holding the GIL as this does; the columns below may be ranges of
     * that table's file */
    if (!engine_table_rows(t, &l->rows, &generation)) {
        PyErr_SetString(PyExc_ValueError, "locate: no table attached");
        goto fail;
    }
    if (column(t, offset, &l->offset, (int64_t)(l->rows * WIDTH_OFFSET), "offset")
        || column(t, length, &l->length, (int64_t)(l->rows * WIDTH_LENGTH), "length")
        || column(t, check, &l->check, (int64_t)(l->rows * WIDTH_CHECK), "check")
        || column(t, prefix, &l->prefix, (int64_t)(l->rows * WIDTH_PREFIX), "prefix")
        || buffer(prefix_ends, &l->prefix_ends) || buffer(prefixes, &l->prefixes)
        || column(t, inline_bytes, &l->inline_bytes, -1, "inline") || column(t, kept, &l->kept, -1, "kept")
        || buffer(kept_ends, &l->kept_ends))
        goto fail;
    l->nprefixes = (uint64_t)l->prefix_ends.len / 8;
    l->nkept = (uint64_t)l->kept_ends.len / 8;
    for (i = 0; i < (Py_ssize_t)l->nkept; i++) {
        uint64_t end = ((const uint64_t *)l->kept_ends.buf)[i];
        if (l->kept_ends.len % 8 || end > l->kept.len || (i && end < ((const uint64_t *)l->kept_ends.buf)[i - 1])) {
            PyErr_SetString(PyExc_ValueError, "locate: kept frames out of order");
            goto fail;
        }
    }
    for (i = 0; i < (Py_ssize_t)l->nprefixes; i++) {
        uint64_t end = ((const uint64_t *)l->prefix_ends.buf)[i];
        if (l->prefix_ends.len % 8 || end > (uint64_t)l->prefixes.len || (i && end < ((const uint64_t *)l->prefix_ends.buf)[i - 1])) {
            PyErr_SetString(PyExc_ValueError, "locate: prefix ends out of order");
            goto fail;
        }
    }
    if (PyObject_GetBuffer(starts, &view, PyBUF_C_CONTIGUOUS) != 0)
        goto fail;
    nstarts = view.len / 8;
    if (view.len % 8 || nstarts < 2 || (l->starts = malloc((size_t)view.len)) == NULL) {
        PyBuffer_Release(&view);
        PyErr_SetString(PyExc_ValueError, "locate: no blocks");
        goto fail;
    }
    memcpy(l->starts, view.buf, (size_t)view.len);
    PyBuffer_Release(&view);
    l->nblocks = (uint64_t)nstarts - 1;
    for (i = 1; i < nstarts; i++)
        if (l->starts[i] < l->starts[i - 1]) {
            PyErr_SetString(PyExc_ValueError, "locate: block starts out of order");
            goto fail;
        }
    l->unlocated = calloc((size_t)l->nblocks, 1);
    l->data_path = strdup(data_path);
    l->index_path = strdup(index_path);
    if (l->unlocated == NULL || l->data_path == NULL || l->index_path == NULL) {
        PyErr_NoMemory();
        goto fail;
    }
    l->data_size = sig[0];
    l->data_mtime_ns = sig[1];
    l->index_size = sig[2];
    l->index_mtime_ns = sig[3];
    l->compressed = compressed;
    l->max_block_bytes = max_block_bytes;
    if (compressed) {  /* blocks stored as they are are read from data.bin anyway */
        int64_t signatures[4] = {sig[0], sig[1], sig[2], sig[3]};
        l->disk_key = diskblocks_key(self, data_path, signatures);
    }
    if (dictionary != Py_None && (l->dictionary = dictionary_take(dictionary)) == NULL)
        goto fail;
    {
        /* Never a blocking open (a FIFO in its place), never anything but the regular file of
         * the size and mtime the control plane checked when it opened the dataset, and the very
         * file its link rule approved (a link on the path swapped since leads elsewhere). */
        struct stat st;
        if ((l->fd = open_regular(data_path, 0, &st)) < 0)
            goto fail;
        if ((unsigned long long)st.st_dev != identity[0] || (unsigned long long)st.st_ino != identity[1]) {
            PyErr_Format(PyExc_ValueError, "locate: %s is not the file approved when the dataset was opened",
                         data_path);
            goto fail;
        }
        if ((int64_t)st.st_size != l->data_size
            || (int64_t)st.st_mtim.tv_sec * 1000000000 + st.st_mtim.tv_nsec != l->data_mtime_ns) {
            PyErr_Format(PyExc_ValueError, "locate: %s changed since the dataset was opened", data_path);
            goto fail;
        }
    }
    {
        Located *old;
        if (engine_table_locate(t, l, generation, l->rows, &old) != 0) {
            /* attached again or detached while the GIL was released (the open, the lock) */
            PyErr_SetString(PyExc_ValueError, "locate: the table changed");
            goto fail;
        }
        /* the GIL held since: no detach has freed l (it needs the GIL) */
        l->session = self;
        __atomic_add_fetch(&engine_counters(self)->located_stored, (uint64_t)l->data_size, __ATOMIC_RELAXED);
        located_free(old);
    }
    Py_RETURN_NONE;
fail:
    located_free(l);
    return NULL;
}

/* Row `row`'s locator: 1 and `span` filled, or 0 (none, or one that lies). */
static int span_of(const Located *l, uint64_t row, Span *span)
{
    uint32_t offset, length, check;
    uint16_t number;
    if (row >= l->rows || column_read(&l->offset, row * WIDTH_OFFSET, &offset, WIDTH_OFFSET) != 0
        || offset == NO_LOCATOR || column_read(&l->length, row * WIDTH_LENGTH, &length, WIDTH_LENGTH) != 0
        || column_read(&l->prefix, row * WIDTH_PREFIX, &number, WIDTH_PREFIX) != 0
        || column_read(&l->check, row * WIDTH_CHECK, &check, WIDTH_CHECK) != 0)
        return 0;
    span->prefix = NULL;
    span->prefix_len = 0;
    span->offset = span->length = 0;
    span->is_inline = span->is_kept = 0;
    span->check = check;
    if (number == INLINE_PREFIX) {
        if (length >= sizeof span->inline_bytes || column_read(&l->inline_bytes, offset, span->inline_bytes, length) != 0)
            return 0;
        span->is_inline = 1;
        span->length = length;
        return 1;
    }
    if (number == KEPT_PREFIX) {  /* offset and length within the block's kept files: checked there */
        span->is_kept = 1;
        span->offset = offset;
        span->length = length;
        return 1;
    }
    if (number > l->nprefixes)
        return 0;
    if (number) {  /* ends checked ascending and within prefixes at attach */
        const uint64_t *ends = l->prefix_ends.buf;
        uint64_t start = number > 1 ? ends[number - 2] : 0;
        span->prefix_len = (size_t)(ends[number - 1] - start);
        if (span->prefix_len > 0)  /* else NULL: no arithmetic on a buffer that may be NULL */
            span->prefix = (const char *)l->prefixes.buf + start;
    }
    span->offset = offset;
    span->length = length;
    return 1;
}

static int same_file(const char *path, int64_t size, int64_t mtime_ns)
{
    struct stat st;
    return stat(path, &st) == 0 && (int64_t)st.st_size == size
           && (int64_t)st.st_mtim.tv_sec * 1000000000 + st.st_mtim.tv_nsec == mtime_ns;
}

/* The CRC-32 of `size` bytes at `data` after `seed`; nothing is `seed` (zlib answers 0 for a
 * NULL buffer, whatever the seed; `data` may be NULL when size is 0). */
static uint32_t crc(uint32_t seed, const char *data, size_t size)
{
    return size == 0 ? seed : (uint32_t)crc32_z(seed, (const Bytef *)data, size);
}

/* Whether `run` (span->length bytes) after the span's prefix is the file the locator recorded
 * (its CRC-32, as spans/find.py run_check). */
static int run_checks(const Span *span, const char *run)
{
    return crc(crc(0, span->prefix, span->prefix_len), run, (size_t)span->length) == span->check;
}

static pthread_key_t dctx_key;
static pthread_once_t dctx_once = PTHREAD_ONCE_INIT;

static void free_dctx(void *dctx)
{
    ZSTD_freeDCtx(dctx);
}

static void make_dctx_key(void)
{
    pthread_key_create(&dctx_key, free_dctx);
}

/* This thread's decompression context (freed when the thread ends). */
static ZSTD_DCtx *thread_dctx(void)
{
    ZSTD_DCtx *dctx;
    pthread_once(&dctx_once, make_dctx_key);
    dctx = pthread_getspecific(dctx_key);
    if (dctx == NULL && (dctx = ZSTD_createDCtx()) != NULL)
        pthread_setspecific(dctx_key, dctx);
    return dctx;
}

/* Block `block`'s stored bytes (a shard with no compression: its payload), malloc'd: 0, or -1. */
static int load_stored(const Located *l, uint64_t block, char **out, size_t *out_len)
{
    uint64_t start = l->starts[block], stored = l->starts[block + 1] - start;
    char *raw;
    if (stored > l->max_block_bytes || (raw = malloc(stored ? (size_t)stored : 1)) == NULL)
        return -1;
    if (read_full(l->fd, raw, (size_t)stored, start) != 0) {
        free(raw);
        return -1;
    }
    *out = raw;
    *out_len = (size_t)stored;
    return 0;
}

/* Bytes [off, off + size) of the file `first` + `second` (its prefix and run), as one reply. */
static void reply_parts(ReaderRequest *req, const char *first, size_t first_len, const char *second, size_t second_len,
                        size_t size, off_t off)
{
    struct iovec iov[2];
    int n = 0;
    size_t total = first_len + second_len, from = (uint64_t)off < total ? (size_t)off : total;
    size_t want = total - from < size ? total - from : size;
    if (from < first_len && want > 0) {
        size_t part = first_len - from < want ? first_len - from : want;
        iov[n].iov_base = (void *)(first + from);
        iov[n++].iov_len = part;
        want -= part;
        from += part;
    }
    if (want > 0) {
        iov[n].iov_base = (void *)(second + (from - first_len));
        iov[n++].iov_len = want;
    }
    engine_reply(req, iov, n);
}

/* Whether time `t` is at least RACY_S seconds before `now` (compared, never subtracted: a
 * file's times are anyone's to set, to the extremes of time_t). */
#define RACY_S 2
static int settled(const struct timespec *t, const struct timespec *now)
{
    time_t limit = now->tv_sec - RACY_S;  /* a clock's now: no overflow */
    return t->tv_sec < limit || (t->tv_sec == limit && t->tv_nsec <= now->tv_nsec);
}

/* A nonzero token of what l->fd is now (spans/fingerprints.py file_identity): 0 if what is
 * read from it now must not be remembered. */
static uint32_t fd_identity(const Located *l)
{
    struct stat st;
    struct timespec now;
    int64_t key[7];
    if (clock_gettime(CLOCK_REALTIME, &now) != 0 || now.tv_sec < RACY_S || fstat(l->fd, &st) != 0
        || !settled(&st.st_ctim, &now) || !settled(&st.st_mtim, &now))
        return 0;
    key[0] = (int64_t)st.st_dev;
    key[1] = (int64_t)st.st_ino;
    key[2] = (int64_t)st.st_size;
    key[3] = (int64_t)st.st_mtim.tv_sec;
    key[4] = (int64_t)st.st_mtim.tv_nsec;
    key[5] = (int64_t)st.st_ctim.tv_sec;
    key[6] = (int64_t)st.st_ctim.tv_nsec;
    return crc(0, (const char *)key, sizeof key) | 1;
}

/* The CRC-32 of block `block`'s stored bytes (its fingerprint when its frame has no checksum):
 * remembered, or read in pieces (never more than a block may store) and remembered. 0 and
 * `out` set, or -1. */
static int stored_fingerprint(Located *l, uint64_t block, uint32_t *out)
{
    uint64_t start = l->starts[block], stored = l->starts[block + 1] - start, done;
    uint64_t bound = l->compressed ? ZSTD_compressBound((size_t)l->max_block_bytes) : l->max_block_bytes;
    uint64_t *slots = __atomic_load_n(&l->fingerprints, __ATOMIC_ACQUIRE);
    uint32_t identity = fd_identity(l), sum = 0;
    char *piece;
    if (identity != 0 && slots != NULL) {
        uint64_t entry = __atomic_load_n(&slots[block], __ATOMIC_RELAXED);
        if (entry >> 32 == identity) {
            *out = (uint32_t)entry;
            return 0;
        }
    }
    if (stored > bound || (piece = malloc(stored < FINGERPRINT_PIECE ? (size_t)stored + 1 : FINGERPRINT_PIECE)) == NULL)
        return -1;
    for (done = 0; done < stored;) {
        size_t part = stored - done < FINGERPRINT_PIECE ? (size_t)(stored - done) : FINGERPRINT_PIECE;
        if (read_full(l->fd, piece, part, start + done) != 0) {
            free(piece);
            return -1;
        }
        sum = crc(sum, piece, part);
        done += part;
    }
    free(piece);
    if (identity != 0) {
        if (slots == NULL) {  /* the first: made here, or by the thread that made it first */
            uint64_t *made = calloc((size_t)l->nblocks, sizeof *made);
            if (made != NULL && !__atomic_compare_exchange_n(&l->fingerprints, &slots, made, 0, __ATOMIC_ACQ_REL,
                                                             __ATOMIC_ACQUIRE))
                free(made);  /* slots is now the other thread's */
            else
                slots = made;
        }
        if (slots != NULL)
            __atomic_store_n(&slots[block], (uint64_t)identity << 32 | sum, __ATOMIC_RELAXED);
    }
    *out = sum;
    return 0;
}

/* Whether `file` (length bytes, an inline or kept file) is tied to block `block` by the
 * block's fingerprint: the locator's check is the CRC-32 of the file seeded with it. */
static int tied_to_block(Located *l, uint64_t block, const Span *span, const char *file)
{
    uint64_t start = l->starts[block], stored = l->starts[block + 1] - start;
    uint32_t fingerprint;
    int ok = 0;
    if (l->compressed && stored >= 4) {
        unsigned char tail[4];
        if (read_full(l->fd, (char *)tail, 4, start + stored - 4) == 0) {
            fingerprint = tail[0] | tail[1] << 8 | tail[2] << 16 | (uint32_t)tail[3] << 24;
            ok = crc(fingerprint, file, (size_t)span->length) == span->check;
        }
    }
    if (!ok && stored_fingerprint(l, block, &fingerprint) == 0)
        ok = crc(fingerprint, file, (size_t)span->length) == span->check;
    return ok;
}

/* An inline file, once its block's fingerprint ties it to the block: 1, or 0. */
static int serve_inline(Located *l, ReaderRequest *req, uint64_t block, const Span *span, size_t size, off_t off)
{
    if (!tied_to_block(l, block, span, span->inline_bytes))
        return 0;
    reply_parts(req, span->inline_bytes, (size_t)span->length, NULL, 0, size, off);
    return 1;
}

/* Block `block`'s kept files: its frame of the table's kept bytes decompressed (malloc'd),
 * one frame that says its size, within KEPT_BLOCK_MAX, nothing after it. 0, or -1. */
static int load_kept(const Located *l, uint64_t block, char **out, size_t *out_len)
{
    const uint64_t *ends = l->kept_ends.buf;
    uint64_t start = block ? ends[block - 1] : 0, stored = ends[block] - start;  /* checked in order at attach */
    unsigned long long content;
    size_t got;
    char *frame, *files = NULL;
    ZSTD_DCtx *dctx;
    if (stored > ZSTD_compressBound(KEPT_BLOCK_MAX) || (frame = malloc(stored ? (size_t)stored : 1)) == NULL)
        return -1;
    if (column_read(&l->kept, start, frame, (size_t)stored) != 0)
        goto bad;
    content = ZSTD_getFrameContentSize(frame, (size_t)stored);
    if (content == ZSTD_CONTENTSIZE_ERROR || content == ZSTD_CONTENTSIZE_UNKNOWN || content > KEPT_BLOCK_MAX
        || ZSTD_findFrameCompressedSize(frame, (size_t)stored) != stored || (dctx = thread_dctx()) == NULL)
        goto bad;
    if ((files = malloc(content ? (size_t)content : 1)) == NULL)
        goto bad;
    got = ZSTD_decompressDCtx(dctx, files, (size_t)content, frame, (size_t)stored);
    if (ZSTD_isError(got) || got != content)
        goto bad;
    free(frame);
    *out = files;
    *out_len = (size_t)content;
    return 0;
bad:
    free(frame);
    free(files);
    return -1;
}

/* The byte cache's entry of `kind` for `block`, held for reading; made by `make` if this thread
 * is the first to ask (others wait for it). NULL: no room, or `make` failed (-1). */
static CachedBlock *acquire_made(Session *s, const Located *l, uint64_t shard, int kind, uint64_t block,
                                 int (*make)(const Located *, uint64_t, char **, size_t *))
{
    int mine;
    CachedBlock *b = cache_acquire(engine_cache(s), shard, kind, block, &mine);
    if (b != NULL && mine) {
        char *data;
        size_t length;
        if (make(l, block, &data, &length) != 0) {
            cache_abandon(engine_cache(s), b);
            return NULL;
        }
        cache_complete(engine_cache(s), b, data, length);
    }
    return b;
}

/* A kept file, sliced from its block's kept files (decompressed once, kept in the byte cache),
 * once its block's fingerprint ties it to the block: 1, or 0. */
static int serve_kept(Session *s, Located *l, ReaderRequest *req, uint64_t shard, uint64_t block,
                      const Span *span, size_t size, off_t off)
{
    CachedBlock *b;
    int ok;
    if (block >= l->nkept || (b = acquire_made(s, l, shard, KIND_KEPT, block, load_kept)) == NULL)
        return 0;
    ok = span->offset + span->length <= b->length && tied_to_block(l, block, span, b->data + span->offset);
    if (ok)
        reply_parts(req, b->data + span->offset, (size_t)span->length, NULL, 0, size, off);
    cache_release(engine_cache(s), b);
    return ok;
}

#define ZSTD_MAGIC 0xFD2FB528u
/* Files up to this size read in pieces are read whole at their first piece and kept for the
 * next (KIND_RUN); larger ones come from their block's payload. */
#define RUN_KEEP_MAX (8u << 20)
/* Most zstd blocks a frame's map holds (each at least a byte: a frame of tiny blocks is
 * mapped only this far, and its runs past that come from its payload). */
#define FRAME_BLOCKS_MAX 65536

/* One zstd block of a frame: where its header is in the stored block, where its bytes start in
 * the decompressed ones, how many, and how (0: raw, 1: RLE, one byte, 2: compressed: known only
 * once the frame was decompressed that far, decode_frame). */
typedef struct {
    uint64_t pos, decoded;
    uint32_t size, kind;
    uint64_t kept;  /* a compressed one's: where its bytes start in a sparse payload's kept bytes */
} FrameBlock;

/* A sparse payload (KIND_PAYLOAD, CachedBlock.sparse): what a decompressed frame costs the
 * cache when some of its zstd blocks are stored raw (incompressible bytes: JPEG), whose bytes
 * a pread of data.bin gives as they are. Its data: this head, the map of the `nmap` zstd blocks
 * it covers (from the first: `length` decompressed bytes), then the decompressed bytes of its
 * compressed zstd blocks only, one after another (`kept` bytes). A run is assembled from preads
 * of the raw pieces, copies of the kept ones and one byte repeated for RLE (assemble_run). */
typedef struct {
    uint64_t nmap, kept;
} SparseHead;

/* The map of block `block`'s frame (malloc'd, *n entries): its zstd blocks from the first, up
 * to the first compressed one (whose size once decompressed is not told) or the frame's end.
 * Only the frame header and the 3-byte block headers are read. 0, or -1 (no zstd frame). The
 * first decompression of the frame maps it further (decode_frame: every zstd block it made). */
static int map_frame(const Located *l, uint64_t block, FrameBlock **out, size_t *n)
{
    uint64_t start = l->starts[block], stored = l->starts[block + 1] - start, decoded = 0, pos;
    unsigned char head[18];
    size_t count = 0, room = 16;
    FrameBlock *map;
    if (stored < 6 || read_full(l->fd, (char *)head, stored < 18 ? (size_t)stored : 18, start) != 0
        || (head[0] | head[1] << 8 | head[2] << 16 | (uint32_t)head[3] << 24) != ZSTD_MAGIC)
        return -1;
    {
        static const int dict_id_bytes[4] = {0, 1, 2, 4};
        int single_segment = head[4] >> 5 & 1;
        int fcs_bytes = (head[4] >> 6) == 0 ? single_segment : 1 << (head[4] >> 6);
        pos = 5 + (single_segment ? 0 : 1) + (uint64_t)dict_id_bytes[head[4] & 3] + (uint64_t)fcs_bytes;
    }
    if ((map = malloc(room * sizeof *map)) == NULL)
        return -1;
    while (count < FRAME_BLOCKS_MAX && decoded <= l->max_block_bytes && pos + 3 <= stored) {
        unsigned char h[3];
        uint32_t value, kind, size;
        if (read_full(l->fd, (char *)h, 3, start + pos) != 0)
            break;
        value = h[0] | h[1] << 8 | (uint32_t)h[2] << 16;
        kind = value >> 1 & 3;
        size = value >> 3;
        if (kind > 1 || pos + 3 + (kind == 0 ? size : 1) > stored)
            break;  /* compressed (or reserved), or cut short: the rest is the payload's */
        if (count == room) {
            FrameBlock *grown = realloc(map, 2 * room * sizeof *map);
            if (grown == NULL)
                break;
            map = grown;
            room *= 2;
        }
        map[count].pos = pos;
        map[count].decoded = decoded;
        map[count].size = size;
        map[count].kind = kind;
        map[count].kept = 0;
        count++;
        pos += 3 + (kind == 0 ? size : 1);
        decoded += size;
        if (value & 1)
            break;  /* the frame's last block */
    }
    *out = map;
    *n = count;
    return 0;
}

/* Most pieces a run's raw zstd blocks are read in at once (one preadv). */
#define IOV_PIECES 64

/* `n` pieces (iov) of block `block`'s stored bytes from `at` on, one after another, into
 * their buffers: 0, or -1. */
static int read_pieces(const Located *l, const struct iovec *iov, int n, uint64_t at)
{
    size_t total = 0;
    ssize_t got;
    int i;
    for (i = 0; i < n; i++)
        total += iov[i].iov_len;
    do
        got = preadv(l->fd, iov, n, (off_t)at);
    while (got < 0 && errno == EINTR);
    if (got == (ssize_t)total)
        return 0;
    for (i = 0; i < n; i++) {  /* a short read: piece by piece */
        if (read_full(l->fd, iov[i].iov_base, iov[i].iov_len, at) != 0)
            return -1;
        at += iov[i].iov_len;
    }
    return 0;
}

/* Decompressed bytes [run_start, run_start + run_len) of block `block` into `out`, from the
 * `n` zstd blocks of `map` (from the frame's first, up to `covered` decompressed bytes):
 * a raw one's bytes read where they lie in data.bin (consecutive raw ones in one preadv, their
 * 3-byte headers read into a scratch), an RLE one's byte repeated, a compressed one's copied
 * from `kept` (`kept_len` bytes; NULL: none, a run over a compressed one is then not
 * possible). Every entry used is checked first: contiguous, within the frame's stored bytes,
 * the decompressed bytes covered and the kept ones. 0, or -1. */
static int assemble_run(const Located *l, uint64_t block, const FrameBlock *map, size_t n, uint64_t covered,
                        const char *kept, uint64_t kept_len, uint64_t run_start, uint64_t run_len, char *out)
{
    uint64_t start = l->starts[block], stored = l->starts[block + 1] - start;
    uint64_t run_end = run_start + run_len, at, from = 0, next = 0;
    size_t lo_i = 0, hi_i = n, i;
    struct iovec iov[IOV_PIECES];
    char headers[IOV_PIECES][3];
    int pieces = 0;
    if (run_len == 0 || run_end < run_start || run_end > covered)
        return -1;
    while (lo_i < hi_i) {  /* the first zstd block ending past the run's start */
        size_t mid = lo_i + (hi_i - lo_i) / 2;
        if (map[mid].decoded + map[mid].size <= run_start)
            lo_i = mid + 1;
        else
            hi_i = mid;
    }
    for (i = lo_i, at = run_start; at < run_end; i++) {  /* checked, before any byte is read */
        const FrameBlock *f = &map[i];
        if (i >= n || f->decoded > at || f->size > covered - f->decoded)
            return -1;
        if (f->decoded + f->size <= at)
            continue;  /* an empty one */
        if (f->kind == 0 ? f->pos > stored || stored - f->pos < 3 || f->size > stored - f->pos - 3
            : f->kind == 1 ? f->pos > stored || stored - f->pos < 4
            : f->kind == 2 ? kept == NULL || f->kept > kept_len || f->size > kept_len - f->kept
                           : 1)
            return -1;
        at = f->decoded + f->size;
    }
    for (i = lo_i, at = run_start; at < run_end; i++) {
        const FrameBlock *f = &map[i];
        uint64_t hi = run_end < f->decoded + f->size ? run_end : f->decoded + f->size, rel;
        char *to;
        if (hi <= at)
            continue;
        rel = at - f->decoded;
        to = out + (at - run_start);
        if (f->kind == 0) {
            uint64_t pos = f->pos + 3 + rel;
            if (pieces > 0 && (pieces > IOV_PIECES - 2 || pos != next + 3)) {
                if (read_pieces(l, iov, pieces, start + from) != 0)
                    return -1;
                pieces = 0;
            }
            if (pieces == 0) {
                from = pos;
            } else {  /* the header between the last raw piece and this one, read into a scratch */
                iov[pieces].iov_base = headers[pieces];
                iov[pieces++].iov_len = 3;
            }
            iov[pieces].iov_base = to;
            iov[pieces++].iov_len = (size_t)(hi - at);
            next = pos + (hi - at);
        } else if (f->kind == 1) {  /* RLE: one byte, `size` times */
            unsigned char byte;
            if (read_full(l->fd, (char *)&byte, 1, start + f->pos + 3) != 0)
                return -1;
            memset(to, byte, (size_t)(hi - at));
        } else {
            memcpy(to, kept + f->kept + rel, (size_t)(hi - at));
        }
        at = hi;
    }
    if (pieces > 0 && read_pieces(l, iov, pieces, start + from) != 0)
        return -1;
    return 0;
}

/* The run at `span`, read from where it lies in data.bin without decompressing (into `out`,
 * span->length bytes): the stored bytes of a block with no compression, or, in a zstd frame,
 * when every zstd block over it is stored raw (incompressible data: JPEG bytes) or as one
 * repeated byte (in `map`, the frame's map). 0, or -1 (a compressed block over it). */
static int read_stored_run(const Located *l, uint64_t block, const Span *span, char *out, const FrameBlock *map,
                           size_t n)
{
    uint64_t stored = l->starts[block + 1] - l->starts[block];
    if (!l->compressed)
        return span->offset + span->length <= stored
                   ? read_full(l->fd, out, (size_t)span->length, l->starts[block] + span->offset) : -1;
    if (n == 0)
        return -1;
    return assemble_run(l, block, map, n, map[n - 1].decoded + map[n - 1].size, NULL, 0, span->offset,
                        span->length, out);
}

/* The file (prefix and run) read alone, checked, without the block's payload
 * (read_stored_run, the frame's map kept in the byte cache), and answered; with `keep`, kept
 * in the byte cache for the file's next requests (KIND_RUN). 1 answered, 0 not possible (the
 * payload then). */
static int serve_stored_run(Session *s, const Located *l, ReaderRequest *req, uint64_t shard, uint64_t row,
                            uint64_t block, const Span *span, size_t size, off_t off, int keep)
{
    CachedBlock *m = NULL, *kept;
    size_t length = span->prefix_len + (size_t)span->length;
    char *file;
    int ok, mine;
    if (l->compressed) {
        m = cache_acquire(engine_cache(s), shard, KIND_FRAME, block, &mine);
        if (m == NULL)
            return 0;
        if (mine) {
            FrameBlock *map = NULL;
            size_t n = 0;
            if (map_frame(l, block, &map, &n) != 0) {
                cache_abandon(engine_cache(s), m);
                return 0;
            }
            cache_complete(engine_cache(s), m, (char *)map, n * sizeof *map);
        }
        if (m->length == 0) {  /* its first zstd block is compressed: nothing stored as is */
            cache_release(engine_cache(s), m);
            return 0;
        }
    }
    file = malloc(length ? length : 1);
    ok = file != NULL
         && read_stored_run(l, block, span, file + span->prefix_len, m ? (const FrameBlock *)m->data : NULL,
                            m ? m->length / sizeof(FrameBlock) : 0) == 0
         && run_checks(span, file + span->prefix_len);
    if (m != NULL)
        cache_release(engine_cache(s), m);
    engine_count(s, ST_STORED, ok);
    if (!ok) {
        free(file);
        return 0;
    }
    if (span->prefix_len > 0)  /* a run with no prefix has a NULL one: memcpy's arguments must not be NULL */
        memcpy(file, span->prefix, span->prefix_len);
    reply_parts(req, file, length, NULL, 0, size, off);
    if (keep && (kept = cache_acquire(engine_cache(s), shard, KIND_RUN, row, &mine)) != NULL) {
        if (mine) {
            cache_complete(engine_cache(s), kept, file, length);  /* the cache's now */
            file = NULL;
        }
        cache_release(engine_cache(s), kept);
    }
    free(file);
    return 1;
}

/* Stored bytes of a frame read at a time into a worker's window: at least a zstd block (128 KiB)
 * and its header. */
#define WINDOW_BYTES (512u << 10)

static pthread_key_t window_key;
static pthread_once_t window_once = PTHREAD_ONCE_INIT;

static void make_window_key(void)
{
    pthread_key_create(&window_key, free);
}

/* This thread's window (WINDOW_BYTES, freed when the thread ends), or NULL. */
static char *thread_window(void)
{
    char *w;
    pthread_once(&window_once, make_window_key);
    w = pthread_getspecific(window_key);
    if (w == NULL && (w = malloc(WINDOW_BYTES)) != NULL && pthread_setspecific(window_key, w) != 0) {
        free(w);
        w = NULL;
    }
    return w;
}

/* The size block `block`'s zstd frame says it decompresses to, in *content: 0, or -1 (no
 * frame header that says it, or past max_block_bytes). */
static int frame_content(const Located *l, uint64_t block, uint64_t *content)
{
    uint64_t start = l->starts[block], stored = l->starts[block + 1] - start;
    unsigned char head[18];  /* ZSTD_FRAMEHEADERSIZE_MAX */
    size_t n = stored < sizeof head ? (size_t)stored : sizeof head;
    unsigned long long size;
    if (n == 0 || stored > ZSTD_compressBound((size_t)l->max_block_bytes) || read_full(l->fd, (char *)head, n, start) != 0)
        return -1;
    size = ZSTD_getFrameContentSize(head, n);
    if (size == ZSTD_CONTENTSIZE_ERROR || size == ZSTD_CONTENTSIZE_UNKNOWN || size > l->max_block_bytes)
        return -1;
    *content = size;
    return 0;
}

/* A zstd frame being decompressed zstd block by zstd block (zstd's buffer-less decoder) into
 * `dst` (`cap` bytes), its stored bytes read WINDOW_BYTES at a time into the worker's window (no
 * buffer of the whole frame), resumable: decoder_run goes up to a point and returns, and a later
 * call of the same worker goes on from there (the context and the window are the worker's own,
 * which nothing else uses meanwhile). `map`: every zstd block made so far, raw, RLE or
 * compressed (NULL once there was no memory for more: it stays a prefix of the frame's). */
typedef struct {
    const Located *l;
    uint64_t start, stored, content;
    uint64_t pos, wpos, wlen;  /* the next input; the window holds stored bytes [wpos, wpos + wlen) */
    char *dst, *w;
    size_t cap, out, count, room;
    FrameBlock *map, pending;
    ZSTD_DCtx *dctx;
    int mapping, done;
} Decoder;

/* Block `block`'s frame (`content`: what its header says) to be decompressed into `dst`: 0, or -1. */
static int decoder_begin(Decoder *d, const Located *l, uint64_t block, char *dst, size_t cap, uint64_t content)
{
    size_t got;
    memset(d, 0, sizeof *d);
    d->l = l;
    d->start = l->starts[block];
    d->stored = l->starts[block + 1] - d->start;
    d->content = content;
    d->dst = dst;
    d->cap = cap;
    d->mapping = 1;
    d->dctx = thread_dctx();
    d->w = thread_window();
    if (d->dctx == NULL || d->w == NULL || cap > content)
        return -1;
    got = l->dictionary != NULL ? ZSTD_decompressBegin_usingDDict(d->dctx, dictionary_ddict(l->dictionary))
                                : ZSTD_decompressBegin(d->dctx);
    return ZSTD_isError(got) ? -1 : 0;
}

/* The frame decompressed on, up to the zstd block that reaches `want` (a file's end: its bytes
 * are then checked by their CRC-32) or, with `want` >= content, to its end, checked as
 * codec.decompress does (one frame, its checksum if it has one, `content` bytes, nothing after
 * it). 0, or -1 (the decoder is then of no more use: decoder_end). */
static int decoder_run(Decoder *d, uint64_t want)
{
    const Located *l = d->l;
    for (;;) {
        size_t n, got;
        ZSTD_nextInputType_e type;
        const char *src;
        int is_block;
        if (want < d->content && d->out >= want)
            return 0;  /* at a zstd block's end: what was asked is there */
        n = ZSTD_nextSrcSizeToDecompress(d->dctx);
        if (n == 0) {
            d->done = 1;
            break;
        }
        type = ZSTD_nextInputType(d->dctx);
        is_block = type == ZSTDnit_block || type == ZSTDnit_lastBlock;
        if (type == ZSTDnit_skippableFrame || n > WINDOW_BYTES || n > d->stored - d->pos)
            return -1;
        if (d->pos + n > d->wpos + d->wlen) {  /* read on: what is left of the window first */
            uint64_t keep = d->wpos + d->wlen - d->pos, more;
            if (keep > 0)
                memmove(d->w, d->w + (d->pos - d->wpos), (size_t)keep);
            d->wpos = d->pos;
            d->wlen = keep;
            more = d->stored - (d->wpos + d->wlen);
            if (more > WINDOW_BYTES - d->wlen)
                more = WINDOW_BYTES - d->wlen;
            if (want < d->content) {
                /* Up to a file's end: little past what reaching it can take (a zstd block stores
                 * at most its decompressed bytes and a 3-byte header, but for a few of RLE),
                 * so that the read it answers reads no stored bytes it does not need. */
                uint64_t ahead = (want - d->out) + (want - d->out) / 16 + 4096;
                if (ahead < n - keep)
                    ahead = n - keep;
                if (more > ahead)
                    more = ahead;
            }
            if (read_full(l->fd, d->w + d->wlen, (size_t)more, d->start + d->wpos + d->wlen) != 0)
                return -1;
            d->wlen += more;
            if (d->pos + n > d->wpos + d->wlen)
                return -1;
        }
        src = d->w + (d->pos - d->wpos);
        if (type == ZSTDnit_blockHeader) {
            uint32_t value = (unsigned char)src[0] | (uint32_t)(unsigned char)src[1] << 8
                             | (uint32_t)(unsigned char)src[2] << 16;
            d->pending.pos = d->pos;
            d->pending.kind = value >> 1 & 3;
        }
        got = ZSTD_decompressContinue(d->dctx, d->dst + d->out, d->cap - d->out, src, n);
        if (ZSTD_isError(got) || got > d->cap - d->out)
            return -1;
        if (is_block && d->mapping) {
            if (d->count == d->room) {
                size_t grown_room = d->room ? 2 * d->room : 64;
                FrameBlock *grown = d->count < FRAME_BLOCKS_MAX ? realloc(d->map, grown_room * sizeof *d->map) : NULL;
                if (grown == NULL)
                    d->mapping = 0;  /* mapped this far: the map stays a prefix of the frame's */
                else {
                    d->map = grown;
                    d->room = grown_room;
                }
            }
            if (d->mapping) {
                d->pending.decoded = d->out;
                d->pending.size = (uint32_t)got;  /* at most a zstd block's 128 KiB */
                d->map[d->count++] = d->pending;
            }
        }
        d->out += got;
        d->pos += n;
    }
    return d->out == d->content && d->pos == d->stored ? 0 : -1;
}

/* The map learnt (malloc'd, *n entries; the caller's from now), or NULL with *n 0. */
static FrameBlock *decoder_take_map(Decoder *d, size_t *n)
{
    FrameBlock *map = d->map;
    *n = map != NULL ? d->count : 0;
    d->map = NULL;
    d->count = d->room = 0;
    return map;
}

static void decoder_end(Decoder *d)
{
    free(d->map);
    d->map = NULL;
}

/* Block `block`'s zstd frame decompressed into `dst` (`cap` bytes; `content`: what its header
 * says): the whole frame, or with `want` < content only up to the zstd block that reaches `want`
 * (decoder_run). *decoded: the bytes made; *map_out, *nmap: every zstd block made (malloc'd;
 * NULL when there was no memory for it). 0, or -1. */
static int decode_frame(const Located *l, uint64_t block, char *dst, size_t cap, uint64_t content, uint64_t want,
                        size_t *decoded, FrameBlock **map_out, size_t *nmap)
{
    Decoder d;
    *map_out = NULL;
    *nmap = 0;
    *decoded = 0;
    if (decoder_begin(&d, l, block, dst, cap, content) != 0 || decoder_run(&d, want) != 0 || d.out < want) {
        decoder_end(&d);
        return -1;
    }
    *decoded = d.out;
    *map_out = decoder_take_map(&d, nmap);
    return 0;
}

/* Whether block `block`'s payload is made whole and kept for the pass rather than only up to
 * the file read: when the cache's bound holds what a pass over the shards read in C would keep
 * (their stored bytes, at what the whole payloads made so far cost the cache a stored byte: a
 * sparse one keeps only its compressed zstd blocks' bytes). A shuffled pass then reads a kept
 * block's other files from it (one decompression a block a pass). With less, a block is mostly
 * evicted before its next file is read, and each read makes only what it needs (on average half
 * a block): on the shuffle bench (kept 1/4 of the stored bytes), with a bound half of what the
 * pass keeps, whole payloads read 1,314 files/s and partial ones 2,147. The first payload is
 * made whole: what one costs is not known before. */
static int keep_whole(Session *s, const Located *l, uint64_t block)
{
    uint64_t stored = l->starts[block + 1] - l->starts[block];
    uint64_t made = __atomic_load_n(&engine_counters(s)->kept_made, __ATOMIC_RELAXED);
    uint64_t of = __atomic_load_n(&engine_counters(s)->kept_stored, __ATOMIC_RELAXED);
    double per_byte = of ? (double)made / (double)of : 0.0, need;
    if (of == 0)
        return 1;
    need = (double)__atomic_load_n(&engine_counters(s)->located_stored, __ATOMIC_RELAXED) * per_byte;
    return (double)stored * per_byte <= (double)engine_cache(s)->bound && need <= (double)engine_cache(s)->bound;
}

/* How many frames' buffers beside what a pass keeps the cache must have room for before a first
 * read is answered ahead of its frame's end (grow_fits). */
#define GROW_ROOM_FRAMES 4

/* Whether a payload to be made whole may answer its first read before the rest of its frame is
 * decompressed (acquire_payload's growing): its frame's buffer then stays reserved until the rest
 * is made, while the next reads make theirs. Only where the cache's bound holds what a pass over
 * the attached shards keeps (at what whole payloads cost so far; all their stored bytes before
 * the first) and GROW_ROOM_FRAMES such buffers besides: with a bound just large enough for the
 * pass (bench/shuffle.py's 2,000 JPEGs with --cache-size 20M), the longer reservations evicted
 * payloads that were then made again, 33-55% more frames decompressed by 1 reader. */
static int grow_fits(Session *s, uint64_t content)
{
    uint64_t made = __atomic_load_n(&engine_counters(s)->kept_made, __ATOMIC_RELAXED);
    uint64_t of = __atomic_load_n(&engine_counters(s)->kept_stored, __ATOMIC_RELAXED);
    double per_byte = of ? (double)made / (double)of : 1.0;
    double need = (double)__atomic_load_n(&engine_counters(s)->located_stored, __ATOMIC_RELAXED) * per_byte;
    return need + (double)GROW_ROOM_FRAMES * (double)content <= (double)engine_cache(s)->bound;
}

/* The sparse payload of the `decoded` bytes at `data` (a frame decompressed from its start,
 * `map`: its `nmap` zstd blocks), malloc'd into *out (*out_len bytes, SparseHead): 1, or 0 when
 * that would not pay (its raw zstd blocks are less than an eighth of it: text; or the map does
 * not cover it; or no memory): the payload is then the decompressed bytes themselves. */
static int make_sparse(const char *data, size_t decoded, const FrameBlock *map, size_t nmap, char **out,
                       size_t *out_len)
{
    uint64_t raw = 0, kept = 0, at = 0;
    size_t i, head;
    SparseHead *h;
    FrameBlock *m;
    char *blob, *k;
    for (i = 0; i < nmap; i++) {
        if (map[i].decoded != at || map[i].size > decoded - at || map[i].kind > 2)
            return 0;
        at += map[i].size;
        if (map[i].kind == 0)
            raw += map[i].size;
        else if (map[i].kind == 2)
            kept += map[i].size;
    }
    if (at != decoded || raw < decoded / 8)
        return 0;
    head = sizeof *h + nmap * sizeof *m;
    if ((blob = malloc(head + (size_t)kept)) == NULL)
        return 0;
    h = (SparseHead *)blob;
    m = (FrameBlock *)(blob + sizeof *h);
    k = blob + head;
    h->nmap = nmap;
    h->kept = kept;
    for (i = 0, kept = 0; i < nmap; i++) {
        m[i] = map[i];
        m[i].kept = 0;
        if (map[i].kind == 2) {
            m[i].kept = kept;
            if (map[i].size > 0)
                memcpy(k + kept, data + map[i].decoded, map[i].size);
            kept += map[i].size;
        }
    }
    *out = blob;
    *out_len = head + (size_t)kept;
    return 1;
}

/* Runs assembled from a sparse payload up to this size go into the worker's own buffer (kept
 * for its next reads: a fresh one of more than 128 KiB is an mmap, page faults and a munmap
 * each read, which cost the image set's cold random reads 8% of their files/s). */
#define ASSEMBLY_KEEP ((size_t)1 << 20)

typedef struct {
    char *data;
    size_t capacity;
} Scratch;

static pthread_key_t assembly_key;
static pthread_once_t assembly_once = PTHREAD_ONCE_INIT;

static void free_scratch(void *p)
{
    Scratch *sc = p;
    free(sc->data);
    free(sc);
}

static void make_assembly_key(void)
{
    pthread_key_create(&assembly_key, free_scratch);
}

/* A buffer of `size` bytes to assemble a run into: the worker's own (*owned 0), or malloc'd
 * (*owned 1, larger than ASSEMBLY_KEEP or no memory for the worker's); NULL: no memory. */
static char *assembly_buffer(size_t size, int *owned)
{
    Scratch *sc;
    size_t want = size ? size : 1;
    *owned = 1;
    if (want <= ASSEMBLY_KEEP) {
        pthread_once(&assembly_once, make_assembly_key);
        sc = pthread_getspecific(assembly_key);
        if (sc == NULL && (sc = calloc(1, sizeof *sc)) != NULL && pthread_setspecific(assembly_key, sc) != 0) {
            free(sc);
            sc = NULL;
        }
        if (sc != NULL && sc->capacity < want) {
            size_t grown = want < (64u << 10) ? (64u << 10) : want;
            char *data = malloc(grown);
            if (data != NULL) {
                free(sc->data);
                sc->data = data;
                sc->capacity = grown;
            }
        }
        if (sc != NULL && sc->capacity >= want) {
            *owned = 0;
            return sc->data;
        }
    }
    return malloc(want);
}

/* Bytes [offset, offset + length) of the sparse payload `b` (ready, held) into `out`: 0, or -1. */
static int sparse_run(const Located *l, uint64_t block, const CachedBlock *b, uint64_t offset, uint64_t length,
                      char *out)
{
    const SparseHead *h = (const SparseHead *)b->data;
    size_t head;
    if (b->capacity < sizeof *h || h->nmap > (b->capacity - sizeof *h) / sizeof(FrameBlock))
        return -1;
    head = sizeof *h + (size_t)h->nmap * sizeof(FrameBlock);
    if (h->kept != b->capacity - head)
        return -1;
    return assemble_run(l, block, (const FrameBlock *)(b->data + sizeof *h), (size_t)h->nmap, b->length,
                        b->data + head, h->kept, offset, length, out);
}

/* A frame's map learnt by decode_frame kept in the byte cache (KIND_FRAME; replacing a shorter one). */
static void keep_map(Session *s, uint64_t shard, uint64_t block, FrameBlock *map, size_t n)
{
    if (n > 0)
        cache_put(engine_cache(s), shard, KIND_FRAME, block, (char *)map, n * sizeof *map);
    else
        free(map);
}

/* A frame decompressed whole to be written to the decoded cache once the read is answered
 * (serve_run): the payload's own bytes, or (`pooled`) the decompression buffer, whose
 * `reserved` bytes stay reserved until it goes back to the pool. */
typedef struct {
    char *data;
    size_t length, capacity, reserved;
    int pooled;
} Pending;

/* A payload made whole, but answered first: the frame decompressed up to the file read, the
 * payload published as ready that far (growing), the file answered from it, and only then the
 * rest of the frame decompressed (finish_growing) by the same worker, with its own context and
 * window. Readers needing no more than what is ready read it meanwhile; the others wait. */
typedef struct {
    Decoder d;
    size_t cap, capacity;  /* reserved, and the buffer's size */
    int active, to_disk;
} Growing;

/* Block `block`'s payload, at least its first `need` bytes, held for reading: one in the cache,
 * or one another worker is making (waited for: never made twice at once), else made by this
 * worker (a longer one in place of a shorter; its bytes reserved within the cache's bound,
 * *reserved, to settle once served). With compression, *map_out (malloc'd, *nmap_out
 * entries): the frame's map learnt on the way, for keep_map once the payload was given back;
 * with a decoded cache, the frame decompressed whole and *pending what to write of it. A
 * payload to be made whole whose first `need` bytes are well short of its end is made only
 * that far first: grow->active, and finish_growing makes the rest once the read is answered.
 * NULL: no room, or not loadable. */
static CachedBlock *acquire_payload(Session *s, const Located *l, uint64_t shard, uint64_t block, uint64_t need,
                                    size_t *reserved, FrameBlock **map_out, size_t *nmap_out, Pending *pending,
                                    int *on_disk, Growing *grow)
{
    int mine, waited;
    CachedBlock *b = cache_acquire_min(engine_cache(s), shard, KIND_PAYLOAD, block, (size_t)need, &mine, &waited);
    uint64_t content = 0, want;
    size_t cap, capacity = 0, decoded = 0, nmap = 0;
    FrameBlock *map = NULL;
    char *data = NULL;
    int whole, to_disk;
    *reserved = 0;
    *map_out = NULL;
    *nmap_out = 0;
    memset(pending, 0, sizeof *pending);
    grow->active = 0;
    *on_disk = 0;
    if (waited)
        __atomic_add_fetch(&engine_counters(s)->frames_waited, 1, __ATOMIC_RELAXED);
    if (b == NULL || !mine)
        return b;
    if (l->disk_key != 0 && diskblocks_has(s, l->disk_key, block)) {
        /* Written by the worker that made it since this one looked (and its payload evicted
         * meanwhile): read from there, never decompressed twice. */
        cache_abandon(engine_cache(s), b);
        *on_disk = 1;
        return NULL;
    }
    if (!l->compressed) {
        uint64_t stored = l->starts[block + 1] - l->starts[block];
        if (stored > l->max_block_bytes) {  /* before reserving: a lying index would empty the cache */
            cache_abandon(engine_cache(s), b);
            return NULL;
        }
        cache_reserve(engine_cache(s), (size_t)stored);
        if (load_stored(l, block, &data, &decoded) != 0) {
            cache_abandon(engine_cache(s), b);
            cache_unreserve(engine_cache(s), (size_t)stored);
            return NULL;
        }
        cache_complete_reserved(engine_cache(s), b, data, decoded, decoded);
        *reserved = (size_t)stored;
        return b;
    }
    if (frame_content(l, block, &content) != 0 || need > content) {
        cache_abandon(engine_cache(s), b);
        return NULL;
    }
    /* With a decoded cache, whole: written once, never decompressed again. */
    to_disk = l->disk_key != 0 && diskblocks_fits(s, content);
    whole = to_disk || keep_whole(s, l, block) || need >= content - content / 8;
    want = whole ? content : need;
    cap = (size_t)(whole || content - need < ZSTD_BLOCKSIZE_MAX ? content : need + ZSTD_BLOCKSIZE_MAX);
    cache_reserve(engine_cache(s), cap);
    data = buffer_get(engine_cache(s), cap ? cap : 1, &capacity);
    if (data != NULL && whole && need < content - content / 8 && grow_fits(s, content)) {
        /* Whole, but the file read first (the rest once it is answered: finish_growing). */
        if (decoder_begin(&grow->d, l, block, data, cap, content) != 0 || decoder_run(&grow->d, need) != 0
            || grow->d.out < need) {
            decoder_end(&grow->d);
            buffer_put(engine_cache(s), data, capacity);
            cache_abandon(engine_cache(s), b);
            cache_unreserve(engine_cache(s), cap);
            return NULL;
        }
        cache_complete_growing(engine_cache(s), b, data, grow->d.out, capacity);
        grow->active = 1;
        grow->cap = cap;
        grow->capacity = capacity;
        grow->to_disk = to_disk;
        return b;
    }
    if (data == NULL || decode_frame(l, block, data, cap, content, want, &decoded, &map, &nmap) != 0) {
        if (data != NULL)
            buffer_put(engine_cache(s), data, capacity);
        cache_abandon(engine_cache(s), b);
        cache_unreserve(engine_cache(s), cap);
        return NULL;
    }
    __atomic_add_fetch(decoded == content ? &engine_counters(s)->frames_whole : &engine_counters(s)->frames_partial, 1, __ATOMIC_RELAXED);
    to_disk = to_disk && decoded == content;
    {
        char *blob;
        size_t blob_len;
        uint64_t stored = l->starts[block + 1] - l->starts[block];
        if (make_sparse(data, decoded, map, nmap, &blob, &blob_len)) {
            /* Only what cannot be read from disk stays: the decompressed buffer goes back to the
             * pool, and its reservation with it (once written to the decoded cache, if any). */
            b->sparse = 1;
            cache_complete_sized(engine_cache(s), b, blob, decoded, blob_len);
            if (to_disk) {
                pending->data = data;
                pending->length = decoded;
                pending->capacity = capacity;
                pending->reserved = cap;
                pending->pooled = 1;
            } else {
                buffer_put(engine_cache(s), data, capacity);
                cache_unreserve(engine_cache(s), cap);
            }
            cap = 0;
            capacity = blob_len;
        } else {
            cache_complete_reserved(engine_cache(s), b, data, decoded, capacity);
            if (to_disk) {  /* the payload's own bytes: held by this reader until written */
                pending->data = data;
                pending->length = decoded;
            }
        }
        if (decoded == content) {  /* what a whole one costs a stored byte (keep_whole) */
            __atomic_add_fetch(&engine_counters(s)->kept_made, (uint64_t)capacity, __ATOMIC_RELAXED);
            __atomic_add_fetch(&engine_counters(s)->kept_stored, stored, __ATOMIC_RELAXED);
        }
    }
    *reserved = cap;
    *map_out = map;
    *nmap_out = nmap;
    return b;
}

/* The frame `pending` holds written to the decoded cache (when `write`), its buffer and
 * reservation given back. */
static void finish_pending(Session *s, const Located *l, uint64_t block, Pending *pending, int write)
{
    if (pending->data == NULL)
        return;
    if (write)
        diskblocks_write(s, l->disk_key, block, pending->data, pending->length);
    if (pending->pooled) {
        buffer_put(engine_cache(s), pending->data, pending->capacity);
        cache_unreserve(engine_cache(s), pending->reserved);
    }
    pending->data = NULL;
}

/* The payload `b` let go of: its reservation settled (charged as an entry from now), read no more. */
static void let_go(Session *s, CachedBlock *b, size_t reserved)
{
    if (reserved)
        cache_settle(engine_cache(s), b, reserved);
    cache_release(engine_cache(s), b);
}

/* The growing payload `b` (held by this worker, its filler) made whole once its first file was
 * answered (`served`: that file checked out): the rest of its frame decompressed, then the payload
 * kept as sparse (its buffer back to the pool once no reader reads it) or whole, its reservation
 * settled, the frame written to the decoded cache (with one), its map kept; `b` released. A frame
 * that fails on the way, or whose first file did not check out, is left as far as it was ready
 * (a partial payload: its files are checked by their CRC-32 at their first read from it). */
static void finish_growing(Session *s, const Located *l, uint64_t shard, uint64_t block, CachedBlock *b, Growing *g,
                           int served)
{
    ByteCache *c = engine_cache(s);
    ReaderCounters *counters = engine_counters(s);
    uint64_t stored = l->starts[block + 1] - l->starts[block];
    size_t nmap = 0, blob_len = 0;
    FrameBlock *map = NULL;
    char *blob = NULL;
    CachedBlock *sparse = NULL;
    char *data = g->d.dst;
    size_t content = (size_t)g->d.content;
    g->active = 0;
    if (!served || decoder_run(&g->d, g->d.content) != 0) {  /* a file that did not check out: no more of it */
        decoder_end(&g->d);
        __atomic_add_fetch(&counters->frames_partial, 1, __ATOMIC_RELAXED);
        cache_grown(c, b, 0);
        let_go(s, b, g->cap);
        return;
    }
    map = decoder_take_map(&g->d, &nmap);
    decoder_end(&g->d);
    __atomic_add_fetch(&counters->frames_whole, 1, __ATOMIC_RELAXED);
    if (make_sparse(data, content, map, nmap, &blob, &blob_len)
        && (sparse = cache_replace_grown(c, b, blob, content, blob_len)) == NULL)
        free(blob);  /* no memory for its entry: kept whole instead */
    if (sparse != NULL) {
        __atomic_add_fetch(&counters->kept_made, (uint64_t)blob_len, __ATOMIC_RELAXED);
        __atomic_add_fetch(&counters->kept_stored, stored, __ATOMIC_RELAXED);
        if (g->to_disk)  /* `data` is still the old payload's, which this worker holds */
            diskblocks_write(s, l->disk_key, block, data, content);
        cache_release(c, b);
        cache_unreserve(c, g->cap);
        cache_release(c, sparse);
    } else {
        cache_grown(c, b, content);
        __atomic_add_fetch(&counters->kept_made, (uint64_t)g->capacity, __ATOMIC_RELAXED);
        __atomic_add_fetch(&counters->kept_stored, stored, __ATOMIC_RELAXED);
        if (g->to_disk)
            diskblocks_write(s, l->disk_key, block, data, content);
        let_go(s, b, g->cap);
    }
    keep_map(s, shard, block, map, nmap);
}

/* A file read in pieces (`run`: its run, checked) kept whole for its next pieces, which the
 * payload, if it cannot stay in the cache, would otherwise be made again for (KIND_RUN). */
static void keep_pieces(Session *s, uint64_t shard, uint64_t row, const Span *span, const char *run)
{
    uint64_t file_length = span->prefix_len + span->length;
    int mine;
    CachedBlock *kept = cache_acquire(engine_cache(s), shard, KIND_RUN, row, &mine);
    if (kept != NULL && mine) {
        char *file = malloc((size_t)file_length);
        if (file == NULL) {
            cache_abandon(engine_cache(s), kept);
            kept = NULL;
        } else {
            if (span->prefix_len > 0)
                memcpy(file, span->prefix, span->prefix_len);
            memcpy(file + span->prefix_len, run, (size_t)span->length);
            cache_complete(engine_cache(s), kept, file, (size_t)file_length);
        }
    }
    if (kept != NULL)
        cache_release(engine_cache(s), kept);
}

/* The run read from the block's file in the decoded cache, checked, and answered: 1, or 0 (not
 * there; or not as written: dropped, the block is decompressed again). */
static int serve_decoded(Session *s, const Located *l, ReaderRequest *req, uint64_t shard, uint64_t row,
                         uint64_t block, const Span *span, size_t size, off_t off)
{
    int owned = 0, got;
    uint64_t file_length = span->prefix_len + span->length;
    char *run = assembly_buffer((size_t)span->length, &owned);
    if (run == NULL)
        return 0;
    got = diskblocks_read(s, l->disk_key, block, span->offset, (size_t)span->length, run);
    if (got == 0 && !run_checks(span, run)) {  /* a corrupt file: never served */
        diskblocks_drop(s, l->disk_key, block);
        got = -1;
    }
    if (got == 0) {
        reply_parts(req, span->prefix, span->prefix_len, run, (size_t)span->length, size, off);
        if ((off != 0 || size < file_length) && file_length <= RUN_KEEP_MAX)
            keep_pieces(s, shard, row, span, run);
    }
    if (owned)
        free(run);
    return got == 0;
}

/* A run of the block's payload (decompressed once, kept in the byte cache, or read from the
 * decoded cache): 1, or 0. A read of the whole file takes the run alone where it is stored as
 * is (read_stored_run). */
static int serve_run(Session *s, const Located *l, ReaderRequest *req, uint64_t shard, uint64_t row, uint64_t block,
                     const Span *span, size_t size, off_t off)
{
    CachedBlock *b = NULL;
    const char *run;
    char *assembled = NULL;
    int owned = 0;
    uint64_t end = span->offset + span->length;
    size_t reserved = 0, nmap = 0;
    FrameBlock *map = NULL;
    Pending pending = {NULL, 0, 0, 0, 0};
    Growing grow;
    int ok = 0, tries, on_disk = 0;
    if (span->length == 0) {
        if (!run_checks(span, ""))  /* not NULL: zlib answers 0 for a NULL buffer */
            return 0;
        reply_parts(req, span->prefix, span->prefix_len, NULL, 0, size, off);
        return 1;
    }
    if (end > l->max_block_bytes)
        return 0;
    /* The block's payload if it is here already (as far as the run); else its file in the
     * decoded cache; else a read of the whole file takes the run alone where it is stored as
     * is, and the first read of a file read in pieces (the kernel's read-ahead) takes it whole
     * and keeps it for the next pieces. */
    grow.active = 0;
    b = cache_peek(engine_cache(s), shard, KIND_PAYLOAD, block);
    if (b != NULL && __atomic_load_n(&b->length, __ATOMIC_ACQUIRE) < end) {  /* growing meanwhile, maybe */
        cache_release(engine_cache(s), b);
        b = NULL;
    }
    if (b == NULL && l->disk_key != 0 && serve_decoded(s, l, req, shard, row, block, span, size, off))
        return 1;
    if (b == NULL) {
        uint64_t file_length = span->prefix_len + span->length;
        CachedBlock *kept = file_length <= RUN_KEEP_MAX ? cache_peek(engine_cache(s), shard, KIND_RUN, row) : NULL;
        if (kept != NULL) {
            int whole = kept->length == file_length;
            if (whole)
                reply_parts(req, kept->data, kept->length, NULL, 0, size, off);
            cache_release(engine_cache(s), kept);
            if (whole)
                return 1;
        }
        if (off == 0 && size >= file_length) {
            if (serve_stored_run(s, l, req, shard, row, block, span, size, off, 0))
                return 1;
        } else if (file_length <= RUN_KEEP_MAX && serve_stored_run(s, l, req, shard, row, block, span, size, off, 1)) {
            return 1;
        }
    }
    /* A payload another worker made only as far as its own file may end before this run: then
     * this worker makes a longer one (at most twice more: a third would be another's lie). */
    for (tries = 0; b == NULL && tries < 3; tries++) {
        b = acquire_payload(s, l, shard, block, end, &reserved, &map, &nmap, &pending, &on_disk, &grow);
        if (b == NULL && on_disk && serve_decoded(s, l, req, shard, row, block, span, size, off))
            return 1;
        if (b == NULL && on_disk)
            continue;  /* not as written after all (dropped): made here next */
        if (b == NULL)
            return 0;
        if (grow.active && __atomic_load_n(&b->length, __ATOMIC_ACQUIRE) < end) {  /* never: made past `end` */
            finish_growing(s, l, shard, block, b, &grow, 0);
            b = NULL;
        } else if (__atomic_load_n(&b->length, __ATOMIC_ACQUIRE) < end) {
            finish_pending(s, l, block, &pending, 1);
            let_go(s, b, reserved);
            b = NULL;
            reserved = 0;
            keep_map(s, shard, block, map, nmap);
        }
    }
    if (b == NULL)
        return 0;
    if (b->sparse) {
        /* Assembled from disk and the kept bytes: checked every time (its raw pieces are read
         * anew). */
        assembled = assembly_buffer((size_t)span->length, &owned);
        ok = assembled != NULL && sparse_run(l, block, b, span->offset, span->length, assembled) == 0
             && run_checks(span, assembled);
        if (ok && off == 0)  /* once a file (a read in pieces, a second epoch): eviction's guide */
            __atomic_add_fetch(&b->served, span->length, __ATOMIC_RELAXED);
        run = assembled;
    } else {
        run = b->data + span->offset;
        /* A file read in several requests is checked once, at its first. */
        ok = __atomic_load_n(&b->verified, __ATOMIC_ACQUIRE) == row + 1;
        if (!ok && (ok = run_checks(span, run)))
            __atomic_add_fetch(&b->served, span->length, __ATOMIC_RELAXED);
        if (ok)
            __atomic_store_n(&b->verified, row + 1, __ATOMIC_RELEASE);
    }
    if (ok) {
        uint64_t file_length = span->prefix_len + span->length;
        reply_parts(req, span->prefix, span->prefix_len, run, (size_t)span->length, size, off);
        if ((off != 0 || size < file_length) && file_length <= RUN_KEEP_MAX)
            keep_pieces(s, shard, row, span, run);
    }
    if (owned)
        free(assembled);
    /* After the reply: the rest of a growing frame, and the write, cost this reader nothing, and
     * no other (no lock is held; the block's other readers read the payload meanwhile). Only a
     * frame whose run checked out is written. */
    if (grow.active) {
        finish_growing(s, l, shard, block, b, &grow, ok);
        return ok;
    }
    if (reserved)
        cache_settle(engine_cache(s), b, reserved);
    finish_pending(s, l, block, &pending, ok);
    cache_release(engine_cache(s), b);
    keep_map(s, shard, block, map, nmap);  /* after the payload went, if it must: the map stays */
    return ok;
}

int located_read(Session *s, Located *l, ReaderRequest *req, uint64_t shard, uint64_t row, uint64_t block,
                 uint64_t fsize, size_t size, off_t off)
{
    Span span;
    int answered = 0;
    if (block >= l->nblocks || __atomic_load_n(&l->unlocated[block], __ATOMIC_RELAXED)
        || !span_of(l, row, &span) || span.prefix_len + span.length != fsize)
        return 0;
    /* As every read that needs the disk: a data.bin or index.npy changed since the dataset
     * was opened is the control plane's to fail (it says so), not mixed in here. */
    if (!same_file(l->data_path, l->data_size, l->data_mtime_ns)
        || !same_file(l->index_path, l->index_size, l->index_mtime_ns))
        return 0;
    answered = span.is_inline ? serve_inline(l, req, block, &span, size, off)
               : span.is_kept ? serve_kept(s, l, req, shard, block, &span, size, off)
                              : serve_run(s, l, req, shard, row, block, &span, size, off);
    if (!answered)
        __atomic_store_n(&l->unlocated[block], 1, __ATOMIC_RELAXED);
    else
        engine_count(s, ST_READ, 1);
    engine_count(s, ST_LOCATED, answered);
    return answered;
}
