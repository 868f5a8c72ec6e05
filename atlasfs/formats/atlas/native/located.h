/* Atlas's located reads in C (located.c): what the engine (atlasfs/fuse/native) calls. What
 * located.c needs of the engine is reader.h, and only that: it knows no FUSE, no session
 * layout and no table layout but the columns' (layout.h).
 */
#ifndef ATLASFS_LOCATED_H
#define ATLASFS_LOCATED_H

#include "reader.h"

/* Session.locate(shard=, offset=, length=, check=, prefix=, prefix_ends=, prefixes=, inline=,
 * kept=, kept_ends=, data_path=, index_path=, signatures=, starts=, compressed=, dictionary=,
 * max_block_bytes=, data_identity=): the attached table's locators and where its blocks lie. GIL held. */
PyObject *located_attach(Session *self, PyObject *args, PyObject *kwds);
void located_free(Located *l);
/* A read of row `row` (`fsize` bytes, in block `block` of shard position `shard`) answered
 * from where its bytes lie, through `l` (its table's, whose lock the caller holds shared):
 * 1 answered, 0 left to the control plane (and the block not tried here again). */
int located_read(Session *s, Located *l, ReaderRequest *req, uint64_t shard, uint64_t row, uint64_t block,
                 uint64_t fsize, size_t size, off_t off);

#endif
