"""The tree layer: any source as a tree of WebDataset-style files (its file tables in ``table/``, caches, the tar view)."""
