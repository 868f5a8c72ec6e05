/* zstd dictionaries shared by the shards that have the same one.
 *
 * A dataset's shards share its zstd_dict.bin: one decompression dictionary (a copy of its
 * ~100 KiB and its entropy tables) serves every shard located.c reads, however many are
 * attached, instead of one a shard. Entries are counted, and freed with their last shard.
 */
#include "engine.h"

#include <stdlib.h>
#include <string.h>

struct SharedDict {
    SharedDict *next;
    char *bytes;  /* what it was made from, to compare */
    size_t len;
    uint64_t refs;
    ZSTD_DDict *ddict;
};

static SharedDict *dicts;
static pthread_mutex_t dicts_lock = PTHREAD_MUTEX_INITIALIZER;

SharedDict *dictionary_take(const void *bytes, size_t len)
{
    SharedDict *d;
    pthread_mutex_lock(&dicts_lock);
    for (d = dicts; d != NULL; d = d->next)
        if (d->len == len && memcmp(d->bytes, bytes, len) == 0)
            break;
    if (d != NULL) {
        d->refs++;
    } else if ((d = calloc(1, sizeof *d)) != NULL) {
        d->bytes = malloc(len ? len : 1);
        d->ddict = d->bytes != NULL ? ZSTD_createDDict(bytes, len) : NULL;
        if (d->ddict == NULL) {
            free(d->bytes);
            free(d);
            d = NULL;
        } else {
            memcpy(d->bytes, bytes, len);
            d->len = len;
            d->refs = 1;
            d->next = dicts;
            dicts = d;
        }
    }
    pthread_mutex_unlock(&dicts_lock);
    return d;
}

const ZSTD_DDict *dictionary_ddict(const SharedDict *d)
{
    return d != NULL ? d->ddict : NULL;
}

void dictionary_drop(SharedDict *d)
{
    SharedDict **at;
    if (d == NULL)
        return;
    pthread_mutex_lock(&dicts_lock);
    if (--d->refs == 0) {
        for (at = &dicts; *at != NULL && *at != d; at = &(*at)->next)
            ;
        if (*at == d)
            *at = d->next;
    } else {
        d = NULL;
    }
    pthread_mutex_unlock(&dicts_lock);
    if (d != NULL) {
        ZSTD_freeDDict(d->ddict);
        free(d->bytes);
        free(d);
    }
}

size_t dictionary_count(void)
{
    size_t n = 0;
    const SharedDict *d;
    pthread_mutex_lock(&dicts_lock);
    for (d = dicts; d != NULL; d = d->next)
        n++;
    pthread_mutex_unlock(&dicts_lock);
    return n;
}
