/* libfuse 3's low-level operations: each asks the control plane (Python, holding the GIL
 * only for that call), checks what it answered, and replies with the GIL released.
 *
 * OPEN and OPENDIR answer ENOSYS: the kernel (FUSE 7.23/7.29) then stops sending them and
 * their RELEASEs, and keeps file pages cached across opens. Operations left NULL (flush,
 * access, getxattr, writes on this read-only mount) get ENOSYS from libfuse, after which
 * the kernel stops asking too.
 */
#include "engine.h"

#include <errno.h>
#include <string.h>
#include <sys/stat.h>
#include <sys/statvfs.h>
#include <sys/uio.h>

/* Smallest space one entry takes in a listing: the fixed part and a 1-byte name, padded
 * to 8 bytes (struct fuse_dirent is 24 bytes, struct fuse_direntplus 152). */
#define MIN_DIRENT 32
#define MIN_DIRENTPLUS 160
/* Bytes reported as each file's preferred I/O size (st_blksize). */
#define BLOCK_SIZE (128 * 1024)

static Session *session_of(fuse_req_t req)
{
    return fuse_req_userdata(req);
}

void fill_attr(const Session *s, struct stat *st, int is_dir, uint64_t size, double mtime, uint64_t ino)
{
    memset(st, 0, sizeof *st);
    st->st_mode = is_dir ? s->dir_mode : s->file_mode;
    st->st_ino = ino;
    st->st_nlink = 1;  /* tells find not to count sub-folders from nlink */
    st->st_size = (off_t)size;
    st->st_blocks = (blkcnt_t)((size + 511) / 512);  /* 0 blocks would look like a hole to tar */
    st->st_blksize = BLOCK_SIZE;
    st->st_uid = s->uid;
    st->st_gid = s->gid;
    if (mtime > 0 && mtime < 1e15) {
        st->st_mtim.tv_sec = (time_t)mtime;
        st->st_mtim.tv_nsec = (long)((mtime - (double)st->st_mtim.tv_sec) * 1e9);
    }
    st->st_atim = st->st_mtim;
    st->st_ctim = st->st_mtim;
}

/* (is_dir, size, mtime, st_ino) at items[0..3] of a tuple: 0, or -1 if malformed. */
static int parse_attr(const Session *s, PyObject *t, Py_ssize_t at, struct stat *st)
{
    uint64_t size, ino;
    double mtime;
    int is_dir = PyObject_IsTrue(PyTuple_GET_ITEM(t, at));
    if (is_dir < 0 || bridge_u64(PyTuple_GET_ITEM(t, at + 1), &size) || size > INT64_MAX
        || bridge_u64(PyTuple_GET_ITEM(t, at + 3), &ino))
        goto bad;
    mtime = PyFloat_AsDouble(PyTuple_GET_ITEM(t, at + 2));
    if (mtime == -1.0 && PyErr_Occurred())
        goto bad;
    fill_attr(s, st, is_dir, size, mtime, ino);
    return 0;
bad:
    PyErr_Clear();
    return -1;
}

static void op_init(void *userdata, struct fuse_conn_info *conn)
{
    Session *s = userdata;
    PyGILState_STATE gil;
    /* READDIRPLUS_AUTO: attributes with a folder's first reply, and with later ones only if
     * its files were looked up meanwhile (ls -l). Asked for with every name, they cost the
     * kernel an inode for every file `find` lists, and took it 3x as long (the adapter's
     * measurement, docs/performance.md "Listings"). */
    if (conn->capable & FUSE_CAP_READDIRPLUS)
        conn->want |= FUSE_CAP_READDIRPLUS | FUSE_CAP_READDIRPLUS_AUTO;
    if (s->max_read)  /* libfuse refuses the connection unless this matches the mount option */
        conn->max_read = s->max_read;
    if (s->max_readahead)
        conn->max_readahead = s->max_readahead;
    if (s->max_background)
        conn->max_background = s->max_background;
    if (s->congestion_threshold)
        conn->congestion_threshold = s->congestion_threshold;
    if (s->async_read < 0)
        conn->want &= ~FUSE_CAP_ASYNC_READ;
    else if (s->async_read > 0 && (conn->capable & FUSE_CAP_ASYNC_READ))
        conn->want |= FUSE_CAP_ASYNC_READ;
    gil = bridge_enter();
    Py_XDECREF(bridge_call(s, CB_INIT, PyTuple_New(0)));
    bridge_leave(gil);
}

static void op_lookup(fuse_req_t req, fuse_ino_t parent, const char *name)
{
    Session *s = session_of(req);
    struct fuse_entry_param e;
    uint64_t nodeid = 0;
    int err = tables_lookup(s, parent, name, &e);
    PyGILState_STATE gil;
    PyObject *r;
    COUNT(s, ST_LOOKUP, err != 0);
    if (err == 1) {
        e.attr_timeout = s->attr_timeout;
        e.entry_timeout = s->entry_timeout;
        fuse_reply_entry(req, &e);  /* a table row: nothing to forget if the kernel did not take it */
        return;
    }
    if (err < 0) {
        err = -err;
        memset(&e, 0, sizeof e);
        goto reply;
    }
    gil = bridge_enter();
    r = bridge_call(s, CB_LOOKUP, Py_BuildValue("(Ky#)", (unsigned long long)parent, name,
                                                          (Py_ssize_t)strlen(name)));
    memset(&e, 0, sizeof e);
    if (r != NULL && PyTuple_Check(r) && PyTuple_GET_SIZE(r) == 5 && parse_attr(s, r, 1, &e.attr) == 0
        && bridge_u64(PyTuple_GET_ITEM(r, 0), &nodeid) == 0 && nodeid > FUSE_ROOT_ID)
        e.ino = nodeid;
    else
        err = bridge_errno(r, "lookup");
    Py_XDECREF(r);
    bridge_leave(gil);
reply:
    if (err == ENOENT && s->negative_timeout > 0) {
        e.ino = 0;  /* a negative entry the kernel keeps for negative_timeout */
        e.entry_timeout = s->negative_timeout;
        fuse_reply_entry(req, &e);
        return;
    }
    if (err) {
        fuse_reply_err(req, err);
        return;
    }
    e.attr_timeout = s->attr_timeout;
    e.entry_timeout = s->entry_timeout;
    if (fuse_reply_entry(req, &e) != 0) {  /* the kernel did not take it (interrupted): not looked up */
        gil = bridge_enter();
        bridge_forget(s, e.ino, 1);
        bridge_leave(gil);
    }
}

static void op_getattr(fuse_req_t req, fuse_ino_t ino, struct fuse_file_info *fi)
{
    Session *s = session_of(req);
    struct stat st;
    int err = tables_getattr(s, ino, &st);
    PyGILState_STATE gil;
    PyObject *r;
    (void)fi;
    COUNT(s, ST_GETATTR, err != 0);
    if (err != 0) {
        if (err == 1)
            fuse_reply_attr(req, &st, s->attr_timeout);
        else
            fuse_reply_err(req, -err);
        return;
    }
    gil = bridge_enter();
    r = bridge_call(s, CB_GETATTR, Py_BuildValue("(K)", (unsigned long long)ino));
    if (!(r != NULL && PyTuple_Check(r) && PyTuple_GET_SIZE(r) == 4 && parse_attr(s, r, 0, &st) == 0))
        err = bridge_errno(r, "getattr");
    Py_XDECREF(r);
    bridge_leave(gil);
    if (err)
        fuse_reply_err(req, err);
    else
        fuse_reply_attr(req, &st, s->attr_timeout);
}

/* One listing reply: entries (name, is_dir, st_ino, nodeid, size, mtime, next_offset) from
 * the control plane; with `plus`, those with a nodeid carry their attributes and count as
 * looked up. Those that do not fit in `size` bytes are forgotten again at once. */
static void do_readdir(fuse_req_t req, fuse_ino_t ino, size_t size, off_t off, int plus)
{
    Session *s = session_of(req);
    size_t used = 0, max_count = size / (plus ? MIN_DIRENTPLUS : MIN_DIRENT) + 1;
    char *buf = bridge_scratch(size ? size : 1);
    int err = 0;
    Py_ssize_t i, n;
    PyGILState_STATE gil;
    PyObject *r;
    if (buf == NULL) {
        fuse_reply_err(req, ENOMEM);
        return;
    }
    err = tables_readdir(s, req, ino, size, off, plus, buf, &used);
    COUNT(s, ST_READDIR, err != 0);
    if (err != 0) {
        if (err == 1)
            fuse_reply_buf(req, buf, used);
        else
            fuse_reply_err(req, -err);
        return;
    }
    gil = bridge_enter();
    r = bridge_call(s, CB_READDIR, Py_BuildValue("(KLnO)", (unsigned long long)ino, (long long)off,
                                                  (Py_ssize_t)max_count, plus ? Py_True : Py_False));
    if (r == NULL || !PyList_Check(r)) {
        err = bridge_errno(r, "readdir");
        n = 0;
    } else {
        n = PyList_GET_SIZE(r);
    }
    for (i = 0; i < n && !err; i++) {
        PyObject *t = PyList_GET_ITEM(r, i);
        struct fuse_entry_param e;
        uint64_t nodeid, next;
        const char *name;
        Py_ssize_t name_len;
        size_t need;
        if (!PyTuple_Check(t) || PyTuple_GET_SIZE(t) != 7 || !PyBytes_Check(PyTuple_GET_ITEM(t, 0))
            || bridge_u64(PyTuple_GET_ITEM(t, 3), &nodeid) || bridge_u64(PyTuple_GET_ITEM(t, 6), &next)
            || next > INT64_MAX) {
            err = bridge_errno(NULL, "readdir");
            break;
        }
        name = PyBytes_AS_STRING(PyTuple_GET_ITEM(t, 0));
        name_len = PyBytes_GET_SIZE(PyTuple_GET_ITEM(t, 0));
        memset(&e, 0, sizeof e);
        if (name_len == 0 || (size_t)name_len != strlen(name)) {  /* empty, or a NUL inside: not a name */
            err = EIO;
            break;
        }
        {
            /* The attributes are in items 1..5 in another order: is_dir, size, mtime, st_ino. */
            PyObject *attr = PyTuple_Pack(4, PyTuple_GET_ITEM(t, 1), PyTuple_GET_ITEM(t, 4),
                                          PyTuple_GET_ITEM(t, 5), PyTuple_GET_ITEM(t, 2));
            int bad = attr == NULL || parse_attr(s, attr, 0, &e.attr) != 0;
            Py_XDECREF(attr);
            if (bad) {
                PyErr_Clear();
                err = EIO;
                break;
            }
        }
        if (plus) {
            e.ino = nodeid;
            if (nodeid) {
                e.attr_timeout = s->attr_timeout;
                e.entry_timeout = s->entry_timeout;
            }
            need = fuse_add_direntry_plus(req, buf + used, size - used, name, &e, (off_t)next);
        } else {
            need = fuse_add_direntry(req, buf + used, size - used, name, &e.attr, (off_t)next);
        }
        if (need > size - used)
            break;  /* full: this entry and the rest were not handed out */
        used += need;
    }
    /* With READDIRPLUS, the control plane counted every entry with a nodeid as looked up:
     * those not handed out (the reply was full, or is an error) are forgotten again. */
    for (i = err ? 0 : i; plus && i < n; i++) {
        PyObject *rest = PyList_GET_ITEM(r, i);
        uint64_t nodeid;
        if (PyTuple_Check(rest) && PyTuple_GET_SIZE(rest) == 7
            && bridge_u64(PyTuple_GET_ITEM(rest, 3), &nodeid) == 0 && nodeid)
            bridge_forget(s, nodeid, 1);
    }
    Py_XDECREF(r);
    bridge_leave(gil);
    if (err)
        fuse_reply_err(req, err);
    else
        fuse_reply_buf(req, buf, used);
}

static void op_readdir(fuse_req_t req, fuse_ino_t ino, size_t size, off_t off, struct fuse_file_info *fi)
{
    (void)fi;
    do_readdir(req, ino, size, off, 0);
}

static void op_readdirplus(fuse_req_t req, fuse_ino_t ino, size_t size, off_t off, struct fuse_file_info *fi)
{
    (void)fi;
    do_readdir(req, ino, size, off, 1);
}

/* A reply of at most this many pieces is written from the pieces themselves (fuse_reply_iov:
 * no copy here; IOV_MAX is 1024); more are gathered into the worker's buffer (bridge_read_reply). */
#define IOV_PIECES 256

/* A read's reply `r` that is a list of at most IOV_PIECES bytes, `size` bytes at most in all,
 * written to the kernel from its own bytes, the GIL released (`gil`: left here): 1. The list
 * (which holds its pieces, immutable) is kept until this worker's next call into Python. 0:
 * anything else, nothing done. GIL held. */
static int reply_pieces(fuse_req_t req, PyObject *r, size_t size, PyGILState_STATE gil)
{
    struct iovec iov[IOV_PIECES];
    Py_ssize_t i, n;
    size_t total = 0;
    if (r == NULL || !PyList_Check(r) || (n = PyList_GET_SIZE(r)) > IOV_PIECES)
        return 0;
    for (i = 0; i < n; i++) {
        PyObject *piece = PyList_GET_ITEM(r, i);
        if (!PyBytes_Check(piece) || (size_t)PyBytes_GET_SIZE(piece) > size - total)
            return 0;  /* bridge_read_reply says what is wrong */
        iov[i].iov_base = PyBytes_AS_STRING(piece);
        iov[i].iov_len = (size_t)PyBytes_GET_SIZE(piece);
        total += iov[i].iov_len;
    }
    bridge_hold(r);
    bridge_leave(gil);
    if (n == 0)
        fuse_reply_buf(req, NULL, 0);
    else
        fuse_reply_iov(req, iov, (int)n);
    return 1;
}

static void op_read(fuse_req_t req, fuse_ino_t ino, size_t size, off_t off, struct fuse_file_info *fi)
{
    Session *s = session_of(req);
    char *buf = NULL;
    size_t got = 0;
    int err = 0;
    PyGILState_STATE gil;
    PyObject *r;
    int cached = readpath_read(s, req, ino, size, off);  /* a row of an attached table: 1 answered */
    if (cached != 0) {
        if (cached < 0)
            fuse_reply_err(req, -cached);
        return;
    }
    COUNT(s, ST_READ, 0);
    gil = bridge_enter();
    r = bridge_call(s, CB_READ, Py_BuildValue("(KLn)", (unsigned long long)ino, (long long)off,
                                                         (Py_ssize_t)size));
    (void)fi;
    if (reply_pieces(req, r, size, gil))
        return;
    buf = bridge_read_reply(r, size, &got, &err, "read");
    Py_XDECREF(r);
    bridge_leave(gil);
    if (err)
        fuse_reply_err(req, err);
    else
        fuse_reply_buf(req, buf, got);
}

static void op_forget(fuse_req_t req, fuse_ino_t ino, uint64_t nlookup)
{
    Session *s = session_of(req);
    PyGILState_STATE gil;
    if (ino >= TABLE_NODES) {  /* a table row or shard folder: nothing is kept for it */
        fuse_reply_none(req);
        return;
    }
    gil = bridge_enter();
    bridge_forget(s, ino, nlookup);
    bridge_leave(gil);
    fuse_reply_none(req);
}

static void op_forget_multi(fuse_req_t req, size_t count, struct fuse_forget_data *forgets)
{
    Session *s = session_of(req);
    PyGILState_STATE gil;
    PyObject *pairs;
    size_t i, ours = 0;
    for (i = 0; i < count; i++)
        ours += forgets[i].ino < TABLE_NODES;
    if (ours == 0) {  /* table rows only: nothing is kept for them */
        fuse_reply_none(req);
        return;
    }
    gil = bridge_enter();
    pairs = PyList_New(0);
    for (i = 0; pairs != NULL && i < count; i++) {
        PyObject *pair;
        if (forgets[i].ino >= TABLE_NODES)
            continue;
        pair = Py_BuildValue("(KK)", (unsigned long long)forgets[i].ino, (unsigned long long)forgets[i].nlookup);
        if (pair == NULL || PyList_Append(pairs, pair) != 0) {
            Py_XDECREF(pair);
            Py_CLEAR(pairs);
            break;
        }
        Py_DECREF(pair);
    }
    if (pairs != NULL)
        Py_XDECREF(bridge_call(s, CB_FORGET, PyTuple_Pack(1, pairs)));
    else
        PyErr_WriteUnraisable(NULL);
    Py_XDECREF(pairs);
    bridge_leave(gil);
    fuse_reply_none(req);
}

static void op_statfs(fuse_req_t req, fuse_ino_t ino)
{
    Session *s = session_of(req);
    struct statvfs st;
    uint64_t total = 0;
    PyGILState_STATE gil = bridge_enter();
    PyObject *r = bridge_call(s, CB_STATFS, PyTuple_New(0));
    (void)ino;
    if (r != NULL && bridge_u64(r, &total) != 0)
        total = 0;
    Py_XDECREF(r);
    bridge_leave(gil);
    memset(&st, 0, sizeof st);
    st.f_bsize = 4096;
    st.f_frsize = 4096;
    st.f_blocks = total / 4096 + (total % 4096 != 0);
    st.f_namemax = 255;
    fuse_reply_statfs(req, &st);
}

static void op_nosys(fuse_req_t req, fuse_ino_t ino, struct fuse_file_info *fi)
{
    (void)ino;
    (void)fi;
    fuse_reply_err(req, ENOSYS);
}

const struct fuse_lowlevel_ops atlasfs_ops = {
    .init = op_init,
    .lookup = op_lookup,
    .forget = op_forget,
    .forget_multi = op_forget_multi,
    .getattr = op_getattr,
    .open = op_nosys,
    .opendir = op_nosys,
    .read = op_read,
    .readdir = op_readdir,
    .readdirplus = op_readdirplus,
    .statfs = op_statfs,
};
