/* The engine's side of reader.h: what a format's reader in C (located.c) may reach of a
 * session, behind functions, so that it needs neither FUSE's headers nor the Session's layout. */
#include "engine.h"

ByteCache *engine_cache(Session *s)
{
    return &s->cache;
}

ReaderCounters *engine_counters(Session *s)
{
    return &s->counters;
}

void engine_count(Session *s, int kind, int by_c)
{
    COUNT(s, kind, by_c != 0);
}

void engine_reply(ReaderRequest *req, const struct iovec *iov, int count)
{
    fuse_req_t r = (fuse_req_t)req;  /* engine_request's, cast back */
    if (count == 0)
        fuse_reply_buf(r, NULL, 0);
    else
        fuse_reply_iov(r, iov, count);
}
