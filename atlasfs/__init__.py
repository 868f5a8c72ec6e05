"""atlasfs: read, write, verify and mount Atlas datasets."""

from atlasfs.errors import AtlasFormatError, UnsafePickleError
from atlasfs.formats.atlas.dataset import AtlasDataset, Shard
from atlasfs.formats.atlas.meta import CompressionStrategy
from atlasfs.formats.atlas.writer import AtlasWriter
from atlasfs.wids_in_place import wids_in_place

__all__ = ["AtlasDataset", "AtlasFormatError", "AtlasWriter", "CompressionStrategy", "Shard", "UnsafePickleError",
           "wids_in_place"]
__version__ = "0.1.0"
