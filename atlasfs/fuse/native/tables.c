/* Shard file tables attached by the control plane, and the inode space that names their rows.
 *
 * Node ids of table rows carry their meaning (atlasfs/tree/placement.py's shard_ino):
 * shard s's folder is (s + 1) << 32, row i of its table (s + 1) << 32 | (i + 1). Nothing is
 * kept per file: a row's entry is read from the attached columns when asked, and FORGET of
 * such a node is nothing to do. Node ids below 1 << 32 are the control plane's own.
 *
 * The columns are Python buffers (views of the mapped table file, or arrays in memory) the
 * control plane attaches when it has the shard's table and detaches when it lets it go.
 * They are untrusted (a table file may be another user's): every row, offset and length is
 * checked against its buffer's length before it is read. A shard's rwlock guards its
 * columns: readers take it shared and never call Python while holding it; detach takes it
 * exclusive with the GIL released, so no reader ever sees a released buffer.
 */
#include "engine.h"

#include <errno.h>
#include <stddef.h>
#include <string.h>

#define KIND_FILE 0
#define UNKNOWN_SIZE UINT64_MAX

static void release_columns(ShardTable *t)
{
    Py_buffer *columns[] = {&t->names, &t->offsets, &t->kind, &t->size, &t->by_path, &t->block};
    size_t i;
    for (i = 0; i < sizeof columns / sizeof *columns; i++)
        if (columns[i]->obj != NULL)
            PyBuffer_Release(columns[i]);
    located_free(t->located);
    t->located = NULL;
    t->n = 0;
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
    for (i = 0; i < shards; i++)
        pthread_rwlock_init(&s->tables[i].lock, NULL);
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

static int get_column(PyObject *obj, Py_buffer *view, Py_ssize_t itemsize, const char *what)
{
    if (PyObject_GetBuffer(obj, view, PyBUF_C_CONTIGUOUS) != 0)
        return -1;
    if (view->len % itemsize != 0) {
        PyBuffer_Release(view);
        PyErr_Format(PyExc_ValueError, "%s: not a column of %zd-byte items", what, itemsize);
        return -1;
    }
    return 0;
}

PyObject *tables_attach(Session *self, PyObject *args)
{
    Py_ssize_t shard;
    double mtime;
    PyObject *names, *offsets, *kind, *size, *by_path, *block;
    ShardTable fresh, old, *t;
    uint64_t n;
    memset(&fresh, 0, sizeof fresh);
    if (!PyArg_ParseTuple(args, "ndOOOOOO", &shard, &mtime, &names, &offsets, &kind, &size, &by_path, &block))
        return NULL;
    if (shard < 0 || shard >= self->ntables) {
        PyErr_SetString(PyExc_IndexError, "attach: no such shard");
        return NULL;
    }
    if (get_column(names, &fresh.names, 1, "names") || get_column(offsets, &fresh.offsets, 8, "offsets")
        || get_column(kind, &fresh.kind, 1, "kind") || get_column(size, &fresh.size, 8, "size")
        || get_column(by_path, &fresh.by_path, 4, "by_path") || get_column(block, &fresh.block, 4, "block")) {
        release_columns(&fresh);
        return NULL;
    }
    n = (uint64_t)fresh.kind.len;
    if ((uint64_t)fresh.size.len != n * 8 || (uint64_t)fresh.by_path.len != n * 4
        || (uint64_t)fresh.block.len != n * 4
        || (uint64_t)fresh.offsets.len != (n + 1) * 8 || n >= UINT32_MAX) {
        release_columns(&fresh);
        PyErr_SetString(PyExc_ValueError, "attach: columns of different lengths");
        return NULL;
    }
    fresh.n = n;
    fresh.mtime = mtime;
    t = &self->tables[shard];
    Py_BEGIN_ALLOW_THREADS
    pthread_rwlock_wrlock(&t->lock);
    Py_END_ALLOW_THREADS
    old = *t;
    memcpy(&t->names, &fresh.names, sizeof fresh - offsetof(ShardTable, names));
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
    pthread_rwlock_unlock(&t->lock);
    release_columns(&old);
    Py_RETURN_NONE;
}

/* Row `row`'s name, checked against the names blob; 0, or -1 if the table lies. */
static int row_name(const ShardTable *t, uint64_t row, const char **name, size_t *len)
{
    const uint64_t *offsets = t->offsets.buf;
    uint64_t start, end;
    if (row >= t->n)
        return -1;
    start = offsets[row];
    end = offsets[row + 1];
    if (start > end || end > (uint64_t)t->names.len)
        return -1;
    *name = (const char *)t->names.buf + start;
    *len = (size_t)(end - start);
    return 0;
}

/* Fill `st` from row `row` if it is a file of known size: 1; 0 if the control plane must
 * answer (unknown size, an unreadable entry); -1 if the table lies. Lock held. */
static int row_attr(const Session *s, const ShardTable *t, uint64_t row, fuse_ino_t ino, struct stat *st)
{
    uint64_t size;
    if (row >= t->n)
        return -1;
    if (((const uint8_t *)t->kind.buf)[row] != KIND_FILE)
        return 0;
    size = ((const uint64_t *)t->size.buf)[row];
    if (size == UNKNOWN_SIZE)
        return 0;
    if (size > INT64_MAX)
        return -1;
    fill_attr(s, st, 0, size, t->mtime, ino);
    return 1;
}

ShardTable *table_of(Session *s, fuse_ino_t ino, int64_t *row)
{
    uint64_t shard;
    if (ino < TABLE_NODES)
        return NULL;
    shard = (ino >> 32) - 1;
    if (shard >= (uint64_t)s->ntables)
        return NULL;
    *row = (int64_t)(ino & 0xFFFFFFFFu) - 1;
    return &s->tables[shard];
}

int tables_lookup(Session *s, fuse_ino_t parent, const char *name, struct fuse_entry_param *e)
{
    int64_t folder_row;
    ShardTable *t = table_of(s, parent, &folder_row);
    size_t len = strlen(name);
    uint64_t lo = 0, hi;
    int found = 0;
    if (t == NULL || folder_row != -1)
        return 0;
    pthread_rwlock_rdlock(&t->lock);
    if (t->n == 0 && t->kind.obj == NULL) {
        pthread_rwlock_unlock(&t->lock);
        return 0;  /* not attached */
    }
    hi = t->n;
    while (lo < hi) {  /* by_path orders the rows by their names' bytes (flat tables only) */
        uint64_t mid = lo + (hi - lo) / 2, row = ((const uint32_t *)t->by_path.buf)[mid];
        const char *other;
        size_t other_len;
        int cmp;
        if (row_name(t, row, &other, &other_len) != 0) {
            found = -1;
            break;
        }
        cmp = memcmp(name, other, len < other_len ? len : other_len);
        if (cmp == 0)
            cmp = len < other_len ? -1 : len > other_len;
        if (cmp == 0) {
            fuse_ino_t ino = parent + 1 + row;
            memset(e, 0, sizeof *e);
            found = row_attr(s, t, row, ino, &e->attr);
            e->ino = ino;
            break;
        }
        if (cmp < 0)
            hi = mid;
        else
            lo = mid + 1;
    }
    if (lo >= hi && found == 0)
        found = 2;  /* not in the shard */
    pthread_rwlock_unlock(&t->lock);
    if (found == -1)
        return -EIO;
    if (found == 2)
        return -ENOENT;
    return found;
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
    if (t == NULL || folder_row != -1 || off < 0)
        return 0;
    pthread_rwlock_rdlock(&t->lock);
    if (t->kind.obj == NULL) {
        pthread_rwlock_unlock(&t->lock);
        return 0;
    }
    *used = 0;
    /* Offsets as the control plane's: 0 ".", 1 "..", row i at i + 2 (its next is i + 3). */
    for (i = (uint64_t)off; !err; i++) {
        struct fuse_entry_param e;
        const char *name;
        char small[256];
        size_t len, need;
        memset(&e, 0, sizeof e);
        if (i < 2) {
            name = i == 0 ? "." : "..";
            e.attr.st_mode = s->dir_mode;
        } else {
            uint64_t row = i - 2;
            if (row >= t->n)
                break;
            if (row_name(t, row, &name, &len) != 0 || len == 0 || len >= sizeof small
                || memchr(name, '\0', len) != NULL || memchr(name, '/', len) != NULL) {
                err = EIO;
                break;
            }
            memcpy(small, name, len);  /* NUL-terminated for libfuse */
            small[len] = '\0';
            name = small;
            e.attr.st_mode = s->file_mode;
            e.attr.st_ino = folder + 1 + row;
            if (plus && row_attr(s, t, row, folder + 1 + row, &e.attr) == 1) {
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
    return err ? -err : 1;
}
