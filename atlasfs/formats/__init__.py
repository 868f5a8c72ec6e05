"""The formats atlasfs shows, one room each, beside each other.

Formats: atlas, dolma, lavender, pbin, webdataset (the names of ``factory.FORMATS``,
which ``--format`` takes; ``tests/docs/test_docs_formats.py`` keeps this line equal to it).

``source.py`` is the one interface every format answers and ``naming.py`` the naming rules
of its answers; ``factory.py`` finds a
dataset's format from its layout and opens it; ``state.py`` is the one format
every shard's saved state (what ``prepare`` learned) is stored in. ``atlas/``
reads Atlas datasets, ``dolma/`` Dolma documents with their attribute sets,
``lavender/`` Lavender shardsets, ``pbin.py`` Modalities packed token files and
``webdataset/`` WebDataset tar shards. None of them knows FUSE:
:mod:`atlasfs.tree.blocktree` makes any of them a tree.
"""
