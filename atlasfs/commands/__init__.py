"""The commands: ``atlasfs`` and ``mount.fuse.atlasfs``, and what each runs (info, verify, show, export...)."""
