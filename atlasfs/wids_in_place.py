"""Let wids read the tar view's shards in place instead of copying them.

``wids.ShardListDataset`` copies every local shard into its cache folder
before reading it, and takes a lock file beside the copy, which it cannot
create inside a read-only mount. Give it :func:`wids_in_place` as
``localname``: each shard's "local copy" becomes a symbolic link, in a
writable folder of yours, to the shard in the mount; wids finds it present,
takes its lock file beside the link and maps the shard itself.
"""

from __future__ import annotations

import os
from typing import Callable
from urllib.parse import quote, urlparse


def wids_in_place(link_folder: str) -> Callable[[str], str]:
    """A ``localname`` for ``wids.ShardListDataset`` that links shards instead of copying them."""
    os.makedirs(link_folder, exist_ok=True)

    def localname(url: str) -> str:
        path = os.path.abspath(urlparse(url).path)
        link = os.path.join(link_folder, quote(path, safe=""))
        if not os.path.lexists(link):
            try:
                os.symlink(path, link)
            except FileExistsError:  # another worker made it meanwhile
                pass
        return link

    return localname
