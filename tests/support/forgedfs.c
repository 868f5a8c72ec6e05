/* A FUSE file system that lies about owners, as any user's FUSE server may: its root folder
 * holds one symbolic link, `NAME`, to `TARGET`, that says it is owned by `CLAIMED` (root). The
 * mount is made as user `USER`'s would be (the kernel's user_id=USER, allow_other: what
 * /etc/fuse.conf's user_allow_other lets a user ask for), by mount(2) itself, so that this test
 * needs no setuid fusermount and no change to /etc/fuse.conf; it runs as root.
 *
 * Usage: forgedfs MOUNTPOINT NAME TARGET USER CLAIMED
 * Serves until SIGTERM or SIGINT, then unmounts. Built by tests/support/forged.py.
 */
#define FUSE_USE_VERSION 34
#include <errno.h>
#include <fcntl.h>
#include <fuse_lowlevel.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mount.h>
#include <sys/stat.h>
#include <unistd.h>

static const char *name, *target;
static uid_t user, claimed;

static void attributes(fuse_ino_t ino, struct stat *st)
{
    memset(st, 0, sizeof *st);
    st->st_ino = ino;
    st->st_nlink = 1;
    if (ino == FUSE_ROOT_ID) {
        st->st_mode = S_IFDIR | 0755;
        st->st_uid = st->st_gid = user;
    } else {
        st->st_mode = S_IFLNK | 0777;
        st->st_uid = st->st_gid = claimed;  /* the lie */
        st->st_size = (off_t)strlen(target);
    }
}

static void do_lookup(fuse_req_t req, fuse_ino_t parent, const char *asked)
{
    struct fuse_entry_param e;
    if (parent != FUSE_ROOT_ID || strcmp(asked, name) != 0) {
        fuse_reply_err(req, ENOENT);
        return;
    }
    memset(&e, 0, sizeof e);
    e.ino = 2;
    attributes(2, &e.attr);
    fuse_reply_entry(req, &e);
}

static void do_getattr(fuse_req_t req, fuse_ino_t ino, struct fuse_file_info *fi)
{
    struct stat st;
    (void)fi;
    if (ino != FUSE_ROOT_ID && ino != 2) {
        fuse_reply_err(req, ENOENT);
        return;
    }
    attributes(ino, &st);
    fuse_reply_attr(req, &st, 0);
}

static void do_readlink(fuse_req_t req, fuse_ino_t ino)
{
    if (ino != 2)
        fuse_reply_err(req, EINVAL);
    else
        fuse_reply_readlink(req, target);
}

static void do_readdir(fuse_req_t req, fuse_ino_t ino, size_t size, off_t off, struct fuse_file_info *fi)
{
    char buf[1024];
    size_t used = 0;
    struct stat st;
    (void)fi;
    if (ino != FUSE_ROOT_ID) {
        fuse_reply_err(req, ENOTDIR);
        return;
    }
    if (size > sizeof buf)
        size = sizeof buf;
    if (off < 1) {
        attributes(FUSE_ROOT_ID, &st);
        used += fuse_add_direntry(req, buf + used, size - used, ".", &st, 1);
    }
    if (off < 2) {
        attributes(FUSE_ROOT_ID, &st);
        used += fuse_add_direntry(req, buf + used, size - used, "..", &st, 2);
    }
    if (off < 3) {
        attributes(2, &st);
        used += fuse_add_direntry(req, buf + used, size - used, name, &st, 3);
    }
    fuse_reply_buf(req, buf, used > size ? 0 : used);
}

static const struct fuse_lowlevel_ops ops = {
    .lookup = do_lookup,
    .getattr = do_getattr,
    .readlink = do_readlink,
    .readdir = do_readdir,
};

int main(int argc, char **argv)
{
    char options[256], device[64];
    char *fake_argv[] = {argv[0], NULL};
    struct fuse_args args = FUSE_ARGS_INIT(1, fake_argv);
    struct fuse_session *se;
    int fd, rc;
    if (argc != 6) {
        fprintf(stderr, "usage: %s MOUNTPOINT NAME TARGET USER CLAIMED\n", argv[0]);
        return 2;
    }
    name = argv[2];
    target = argv[3];
    user = (uid_t)strtoul(argv[4], NULL, 10);
    claimed = (uid_t)strtoul(argv[5], NULL, 10);
    if ((fd = open("/dev/fuse", O_RDWR | O_CLOEXEC)) < 0) {
        perror("/dev/fuse");
        return 1;
    }
    snprintf(options, sizeof options, "fd=%d,rootmode=40000,user_id=%u,group_id=%u,allow_other", fd,
             (unsigned)user, (unsigned)user);
    if (mount("forgedfs", argv[1], "fuse.forgedfs", MS_NOSUID | MS_NODEV | MS_RDONLY, options) != 0) {
        perror("mount");
        return 1;
    }
    se = fuse_session_new(&args, &ops, sizeof ops, NULL);
    snprintf(device, sizeof device, "/dev/fd/%d", fd);  /* libfuse takes the mounted descriptor */
    if (se == NULL || fuse_set_signal_handlers(se) != 0 || fuse_session_mount(se, device) != 0) {
        umount2(argv[1], MNT_DETACH);
        return 1;
    }
    printf("ready\n");
    fflush(stdout);
    rc = fuse_session_loop(se);
    fuse_remove_signal_handlers(se);
    fuse_session_destroy(se);
    umount2(argv[1], MNT_DETACH);
    return rc != 0;
}
