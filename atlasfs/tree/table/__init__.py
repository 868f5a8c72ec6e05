"""A shard's file table, in one package: what it is, how it is stored, built, kept and held.

``filetable`` is the table itself (numpy columns and one blob of names, searched by path
hash); ``ondisk`` its stored format, mapped and searched in place; ``builder`` builds one a
block at a time; ``store`` keeps tables between mounts (``--index-dir``, beside the
dataset, the user's cache); ``tables`` gives the tree each shard's table (loaded, built,
sized) within the bound of the tables held at once.
"""
