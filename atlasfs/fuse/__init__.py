"""The FUSE layer: libfuse 3's calls translated into tree calls, and a mount's life cycle."""
