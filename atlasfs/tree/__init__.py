"""The tree layer: any source as a tree of WebDataset-style files (tables, naming, caches, the tar view)."""
