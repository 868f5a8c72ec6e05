/* Shard file tables attached by the control plane, and the inode space that names their rows.
 *
 * Node ids of table rows carry their meaning (layout.h's shard_ino and row_ino, as
 * atlasfs/tree/table/layout.py's): shard s's folder is (s + 1) << ROW_BITS, row i of its
 * table that plus 1 + i. Nothing is kept per file: a row's entry is read from the attached
 * columns when asked, and FORGET of such a node is nothing to do. Node ids below TABLE_NODES
 * are the control plane's own.
 *
 * The columns are Python buffers (views of the mapped table file, or arrays in memory) the
 * control plane attaches when it has the shard's table and detaches when it lets it go; or,
 * once it lets go of a stored table every size of which is known, ranges of the table's file,
 * read with pread (file mode, atlasfs/fuse/attachments.py): those hold no memory but the
 * kernel's page cache, so that random readers over more tables than the control plane holds
 * are still answered here.
 * They are untrusted (a table file may be another user's): every row, offset and length is
 * checked against its buffer's length before it is read. A shard's rwlock guards its
 * columns: readers take it shared and never call Python while holding it; detach takes it
 * exclusive with the GIL released, so no reader ever sees a released buffer.
 */
#include "engine.h"

#include <errno.h>
#include <fcntl.h>
#include <stddef.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

/* Bytes of a name compared or listed: NAME_MAX (a longer one is no name the kernel asks for). */
#define NAME_BYTES 255

int read_full(int fd, char *buf, size_t size, uint64_t at)
{
    while (size > 0) {
        ssize_t got = pread(fd, buf, size, (off_t)at);
        if (got < 0 && errno == EINTR)
            continue;
        if (got <= 0)
            return -1;
        buf += got;
        size -= (size_t)got;
        at += (uint64_t)got;
    }
    return 0;
}

int column_read(const Column *c, uint64_t from, void *out, size_t size)
{
    if (from > c->len || size > c->len - from)
        return -1;
    if (size == 0)  /* an empty column's buffer may be NULL */
        return 0;
    if (c->view.obj != NULL) {
        memcpy(out, (const char *)c->view.buf + from, size);
        return 0;
    }
    return read_full(c->fd, out, size, c->at + from);
}

int column_from(PyObject *obj, Column *c, int fd, uint64_t file_size, const char *what)
{
    unsigned long long at, len;
    memset(c, 0, sizeof *c);
    c->fd = -1;
    if (fd >= 0 && PyTuple_Check(obj)) {
        if (!PyArg_ParseTuple(obj, "KK", &at, &len))
            return -1;
        if (at > file_size || len > file_size - at) {
            PyErr_Format(PyExc_ValueError, "%s: past the end of the table's file", what);
            return -1;
        }
        c->fd = fd;
        c->at = at;
        c->len = len;
        return 0;
    }
    if (PyObject_GetBuffer(obj, &c->view, PyBUF_C_CONTIGUOUS) != 0)
        return -1;
    c->len = (uint64_t)c->view.len;
    return 0;
}

void column_release(Column *c)
{
    if (c->view.obj != NULL)
        PyBuffer_Release(&c->view);
    memset(c, 0, sizeof *c);
    c->fd = -1;
}

static void release_columns(ShardTable *t)
{
    Column *columns[] = {&t->names, &t->offsets, &t->kind, &t->size, &t->by_path, &t->block};
    size_t i;
    for (i = 0; i < sizeof columns / sizeof *columns; i++)
        column_release(columns[i]);
    located_free(t->located);  /* before the file: its columns may be the file's */
    t->located = NULL;
    if (t->fd >= 0)
        close(t->fd);
    t->fd = -1;
    t->n = 0;
    t->attached = 0;
}

int tables_init(Session *s, Py_ssize_t shards)
{
    Py_ssize_t i;
    if (shards < 0 || (uint64_t)shards >= (UINT64_C(1) << 31)) {
        PyErr_SetString(PyExc_ValueError, "shards: out of range");
        return -1;
    }
    s->tables = shards ? PyMem_Calloc((size_t)shards, sizeof *s->tables) : NULL;
    if (shards && s->tables == NULL) {
        PyErr_NoMemory();
        return -1;
    }
    for (i = 0; i < shards; i++) {
        pthread_rwlock_init(&s->tables[i].lock, NULL);
        s->tables[i].fd = -1;
    }
    s->ntables = shards;
    return 0;
}

void tables_free(Session *s)
{
    Py_ssize_t i;
    for (i = 0; i < s->ntables; i++) {
        release_columns(&s->tables[i]);
        pthread_rwlock_destroy(&s->tables[i].lock);
    }
    PyMem_Free(s->tables);
    s->tables = NULL;
    s->ntables = 0;
}

int open_regular(const char *path, int flags, struct stat *st)
{
    int fd, err = 0;
    Py_BEGIN_ALLOW_THREADS  /* a slow file system's open or fstat waits without the GIL */
    fd = open(path, O_RDONLY | O_NONBLOCK | O_CLOEXEC | flags);
    if (fd >= 0 && fstat(fd, st) != 0) {
        err = errno;
        close(fd);
        fd = -1;
        errno = err;
    }
    Py_END_ALLOW_THREADS
    if (fd < 0) {
        PyErr_SetFromErrnoWithFilename(PyExc_OSError, path);
        return -1;
    }
    if (!S_ISREG(st->st_mode)) {
        close(fd);
        PyErr_Format(PyExc_ValueError, "%s is not a regular file", path);
        return -1;
    }
    return fd;
}

/* The table file `path` opened (never following a last symbolic link), if it is still the
 * regular file the control plane checked (`identity`: device, inode, size, mtime in ns): its
 * descriptor and size, or -1 with a Python error. */
static int open_table_file(const char *path, const long long identity[4], uint64_t *size)
{
    struct stat st;
    int fd = open_regular(path, O_NOFOLLOW, &st);
    if (fd < 0)
        return -1;
    if ((long long)st.st_dev != identity[0] || (long long)st.st_ino != identity[1]
        || (long long)st.st_size != identity[2]
        || (long long)st.st_mtim.tv_sec * 1000000000LL + st.st_mtim.tv_nsec != identity[3]) {
        close(fd);
        PyErr_Format(PyExc_ValueError, "attach: %s is not the table file that was checked", path);
        return -1;
    }
    *size = (uint64_t)st.st_size;
    return fd;
}

/* attach(shard, mtime, names, offsets, kind, size, by_path, block[, file]): with `file`, a
 * (path, (dev, ino, size, mtime_ns)) of the table's file, columns may be (offset, length) of it. */
PyObject *tables_attach(Session *self, PyObject *args, PyObject *kwds)
{
    static char *kwlist[] = {"shard", "mtime", "names", "offsets", "kind", "size", "by_path", "block", "file", NULL};
    Py_ssize_t shard;
    double mtime;
    PyObject *names, *offsets, *kind, *size, *by_path, *block, *file = Py_None;
    ShardTable fresh, old, *t;
    uint64_t n;
    memset(&fresh, 0, sizeof fresh);
    fresh.fd = -1;
    if (!PyArg_ParseTupleAndKeywords(args, kwds, "ndOOOOOO|O:attach", kwlist, &shard, &mtime, &names, &offsets,
                                     &kind, &size, &by_path, &block, &file))
        return NULL;
    if (shard < 0 || shard >= self->ntables) {
        PyErr_SetString(PyExc_IndexError, "attach: no such shard");
        return NULL;
    }
    if (file != Py_None) {
        const char *path;
        long long identity[4];
        if (!PyArg_ParseTuple(file, "y(LLLL)", &path, &identity[0], &identity[1], &identity[2], &identity[3]))
            return NULL;
        if ((fresh.fd = open_table_file(path, identity, &fresh.file_size)) < 0)
            return NULL;
    }
    if (column_from(names, &fresh.names, fresh.fd, fresh.file_size, "names")
        || column_from(offsets, &fresh.offsets, fresh.fd, fresh.file_size, "offsets")
        || column_from(kind, &fresh.kind, fresh.fd, fresh.file_size, "kind")
        || column_from(size, &fresh.size, fresh.fd, fresh.file_size, "size")
        || column_from(by_path, &fresh.by_path, fresh.fd, fresh.file_size, "by_path")
        || column_from(block, &fresh.block, fresh.fd, fresh.file_size, "block")) {
        release_columns(&fresh);
        return NULL;
    }
    n = fresh.kind.len;
    if (fresh.size.len != n * WIDTH_SIZE || fresh.by_path.len != n * WIDTH_BY_PATH
        || fresh.block.len != n * WIDTH_BLOCK || fresh.offsets.len != (n + 1) * WIDTH_OFFSETS
        || n >= ROW_MASK) {  /* row n - 1's node id is its shard's plus n: within ROW_MASK */
        release_columns(&fresh);
        PyErr_SetString(PyExc_ValueError, "attach: columns of different lengths");
        return NULL;
    }
    fresh.n = n;
    fresh.mtime = mtime;
    fresh.attached = 1;
    t = &self->tables[shard];
    Py_BEGIN_ALLOW_THREADS
    pthread_rwlock_wrlock(&t->lock);
    Py_END_ALLOW_THREADS
    old = *t;
    memcpy(&t->names, &fresh.names, sizeof fresh - offsetof(ShardTable, names));
    t->generation++;
    pthread_rwlock_unlock(&t->lock);
    release_columns(&old);  /* no reader holds them: it would hold the lock */
    Py_RETURN_NONE;
}

PyObject *tables_detach(Session *self, PyObject *args)
{
    Py_ssize_t shard;
    ShardTable old, *t;
    if (!PyArg_ParseTuple(args, "n", &shard))
        return NULL;
    if (shard < 0 || shard >= self->ntables)
        Py_RETURN_NONE;
    t = &self->tables[shard];
    Py_BEGIN_ALLOW_THREADS
    pthread_rwlock_wrlock(&t->lock);
    Py_END_ALLOW_THREADS
    old = *t;
    memset(&t->names, 0, sizeof *t - offsetof(ShardTable, names));
    t->fd = -1;
    t->generation++;
    pthread_rwlock_unlock(&t->lock);
    release_columns(&old);
    Py_RETURN_NONE;
}

ShardTable *engine_table(Session *s, Py_ssize_t shard, const char *what)
{
    if (shard < 0 || shard >= s->ntables) {
        PyErr_Format(PyExc_IndexError, "%s: no such shard", what);
        return NULL;
    }
    return &s->tables[shard];
}

int engine_table_rows(const ShardTable *t, uint64_t *rows, uint64_t *generation)
{
    *rows = t->n;
    *generation = t->generation;
    return t->attached;
}

int engine_table_column(const ShardTable *t, PyObject *obj, Column *c, const char *what)
{
    return column_from(obj, c, t->fd, t->file_size, what);
}

int engine_table_locate(ShardTable *t, Located *l, uint64_t generation, uint64_t rows, Located **old)
{
    Py_BEGIN_ALLOW_THREADS
    pthread_rwlock_wrlock(&t->lock);
    Py_END_ALLOW_THREADS
    if (t->generation != generation || t->n != rows) {
        pthread_rwlock_unlock(&t->lock);
        return -1;
    }
    *old = t->located;
    t->located = l;
    pthread_rwlock_unlock(&t->lock);
    return 0;
}

static int u64_at(const Column *c, uint64_t i, uint64_t *out)
{
    return column_read(c, i * WIDTH_SIZE, out, WIDTH_SIZE);
}

/* Row `row`'s name's length, and up to `cap` of its first bytes in `buf`; 0, or -1 if the table lies. */
static int row_name(const ShardTable *t, uint64_t row, char *buf, size_t cap, size_t *len)
{
    uint64_t bounds[2];
    if (row >= t->n || column_read(&t->offsets, row * WIDTH_OFFSETS, bounds, 2 * WIDTH_OFFSETS) != 0)
        return -1;
    if (bounds[0] > bounds[1] || bounds[1] > t->names.len)
        return -1;
    *len = (size_t)(bounds[1] - bounds[0]);
    return column_read(&t->names, bounds[0], buf, *len < cap ? *len : cap);
}

/* Fill `st` for an entry of `kind` and `size` if it is a file of known size: 1; 0 if the
 * control plane must answer (unknown size, an unreadable entry); -1 if the table lies. */
static int attr_of(const Session *s, const ShardTable *t, uint8_t kind, uint64_t size, fuse_ino_t ino,
                   struct stat *st)
{
    if (kind != KIND_FILE || size == UNKNOWN_SIZE)
        return 0;
    if (size > INT64_MAX)
        return -1;
    fill_attr(s, st, 0, size, t->mtime, ino);
    return 1;
}

/* attr_of row `row`. Lock held. */
static int row_attr(const Session *s, const ShardTable *t, uint64_t row, fuse_ino_t ino, struct stat *st)
{
    uint64_t size = UNKNOWN_SIZE;
    uint8_t kind;
    if (row >= t->n || column_read(&t->kind, row, &kind, 1) != 0
        || (kind == KIND_FILE && u64_at(&t->size, row, &size) != 0))
        return -1;
    return attr_of(s, t, kind, size, ino, st);
}

/* Rows of a listing read at once (a table read from its file: a few preads for them all). */
#define WINDOW_ROWS 128

typedef struct {
    uint64_t first, count;  /* rows first .. first + count - 1 */
    uint64_t offsets[WINDOW_ROWS + 1];
    uint64_t size[WINDOW_ROWS];
    uint8_t kind[WINDOW_ROWS];
    char names[WINDOW_ROWS * NAME_BYTES];
} Window;

/* Rows from `first` on into `w` (as many as fit): 0, or -1 if the table lies. */
static int window_fill(const ShardTable *t, Window *w, uint64_t first)
{
    uint64_t count = t->n - first < WINDOW_ROWS ? t->n - first : WINDOW_ROWS, i;
    w->count = 0;
    if (first >= t->n
        || column_read(&t->offsets, first * WIDTH_OFFSETS, w->offsets, (size_t)(count + 1) * WIDTH_OFFSETS) != 0
        || column_read(&t->kind, first, w->kind, (size_t)count) != 0
        || column_read(&t->size, first * WIDTH_SIZE, w->size, (size_t)count * WIDTH_SIZE) != 0)
        return -1;
    for (i = 0; i < count; i++)
        if (w->offsets[i] > w->offsets[i + 1])
            return -1;
    if (w->offsets[count] > t->names.len)
        return -1;
    while (count > 0 && w->offsets[count] - w->offsets[0] > sizeof w->names)
        count--;  /* longer names: fewer rows (a name past NAME_BYTES fails the listing anyway) */
    if (count == 0 || column_read(&t->names, w->offsets[0], w->names, (size_t)(w->offsets[count] - w->offsets[0])) != 0)
        return -1;
    w->first = first;
    w->count = count;
    return 0;
}

ShardTable *table_of(Session *s, fuse_ino_t ino, int64_t *row)
{
    uint64_t shard;
    if (ino < TABLE_NODES)
        return NULL;
    shard = ino_shard(ino);
    if (shard >= (uint64_t)s->ntables)
        return NULL;
    *row = ino_row(ino);
    return &s->tables[shard];
}

/* The row named `name` (`len` bytes, at most NAME_BYTES): 1 and *found, 0 if there is none,
 * -1 if the table lies. Lock held. */
static int find_row(const ShardTable *t, const char *name, size_t len, uint64_t *found)
{
    uint64_t lo = 0, hi = t->n, row = __atomic_load_n(&t->hint, __ATOMIC_RELAXED);
    char other[NAME_BYTES + 1];
    size_t other_len;
    /* The row after the last one found first: `tar`, `rsync` and `find -exec` look up a
     * folder's files in the order it lists them (a binary search in a table read from its
     * file costs three preads a step). */
    if (row < t->n && row_name(t, row, other, len + 1, &other_len) == 0 && other_len == len
        && memcmp(name, other, len) == 0) {
        *found = row;
        return 1;
    }
    while (lo < hi) {  /* by_path orders the rows by their names' bytes (flat tables only) */
        uint64_t mid = lo + (hi - lo) / 2;
        uint32_t at;
        int cmp;
        /* Enough of the other name to order it against this one. */
        if (column_read(&t->by_path, mid * WIDTH_BY_PATH, &at, WIDTH_BY_PATH) != 0
            || row_name(t, at, other, len + 1, &other_len) != 0)
            return -1;
        cmp = memcmp(name, other, len < other_len ? len : other_len);
        if (cmp == 0)
            cmp = len < other_len ? -1 : len > other_len;
        if (cmp == 0) {
            *found = at;
            return 1;
        }
        if (cmp < 0)
            hi = mid;
        else
            lo = mid + 1;
    }
    return 0;
}

int tables_lookup(Session *s, fuse_ino_t parent, const char *name, struct fuse_entry_param *e)
{
    int64_t folder_row;
    ShardTable *t = table_of(s, parent, &folder_row);
    size_t len = strlen(name);
    uint64_t row = 0;
    int found;
    if (t == NULL || folder_row != -1 || len > NAME_BYTES)
        return 0;
    pthread_rwlock_rdlock(&t->lock);
    if (!t->attached) {
        pthread_rwlock_unlock(&t->lock);
        return 0;
    }
    found = find_row(t, name, len, &row);
    if (found == 1) {
        memset(e, 0, sizeof *e);
        e->ino = parent + 1 + row;
        found = row_attr(s, t, row, e->ino, &e->attr);  /* 1, 0 (the control plane's) or -1 */
        if (found == 1)
            __atomic_store_n(&t->hint, row + 1, __ATOMIC_RELAXED);
    } else if (found == 0) {
        found = -ENOENT;  /* not in the shard */
    }
    pthread_rwlock_unlock(&t->lock);
    return found == -1 ? -EIO : found;
}

int tables_getattr(Session *s, fuse_ino_t ino, struct stat *st)
{
    int64_t row;
    ShardTable *t = table_of(s, ino, &row);
    int found;
    if (t == NULL || row < 0)
        return 0;
    pthread_rwlock_rdlock(&t->lock);
    found = row_attr(s, t, (uint64_t)row, ino, st);
    pthread_rwlock_unlock(&t->lock);
    return found < 0 ? -EIO : found;
}

int tables_readdir(Session *s, fuse_req_t req, fuse_ino_t folder, size_t size, off_t off, int plus,
                   char *buf, size_t *used)
{
    int64_t folder_row;
    ShardTable *t = table_of(s, folder, &folder_row);
    uint64_t i;
    int err = 0;
    Window *w;
    if (t == NULL || folder_row != -1 || off < 0)
        return 0;
    if ((w = malloc(sizeof *w)) == NULL)
        return -ENOMEM;
    w->count = 0;
    pthread_rwlock_rdlock(&t->lock);
    if (!t->attached) {
        pthread_rwlock_unlock(&t->lock);
        free(w);
        return 0;
    }
    *used = 0;
    /* Offsets as the control plane's: 0 ".", 1 "..", row i at i + 2 (its next is i + 3). */
    for (i = (uint64_t)off; !err; i++) {
        struct fuse_entry_param e;
        const char *name;
        char small[NAME_BYTES + 1];
        size_t len, need;
        memset(&e, 0, sizeof e);
        if (i < 2) {
            name = i == 0 ? "." : "..";
            e.attr.st_mode = s->dir_mode;
        } else {
            uint64_t row = i - 2, at;
            if (row >= t->n)
                break;
            if ((row < w->first || row >= w->first + w->count) && window_fill(t, w, row) != 0) {
                err = EIO;
                break;
            }
            at = row - w->first;
            len = (size_t)(w->offsets[at + 1] - w->offsets[at]);
            name = w->names + (w->offsets[at] - w->offsets[0]);
            if (len == 0 || len > NAME_BYTES || memchr(name, '\0', len) != NULL || memchr(name, '/', len) != NULL) {
                err = EIO;
                break;
            }
            memcpy(small, name, len);
            small[len] = '\0';  /* NUL-terminated for libfuse */
            name = small;
            e.attr.st_mode = s->file_mode;
            e.attr.st_ino = folder + 1 + row;
            if (plus && attr_of(s, t, w->kind[at], w->size[at], folder + 1 + row, &e.attr) == 1) {
                e.ino = folder + 1 + row;
                e.attr_timeout = s->attr_timeout;
                e.entry_timeout = s->entry_timeout;
            }
        }
        need = plus ? fuse_add_direntry_plus(req, buf + *used, size - *used, name, &e, (off_t)(i + 1))
                    : fuse_add_direntry(req, buf + *used, size - *used, name, &e.attr, (off_t)(i + 1));
        if (need > size - *used)
            break;
        *used += need;
    }
    pthread_rwlock_unlock(&t->lock);
    free(w);
    return err ? -err : 1;
}
