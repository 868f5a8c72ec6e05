"""atlasfs: read, write, verify and mount Atlas datasets."""

from .sources.atlas.dataset import AtlasDataset, Shard
from .errors import AtlasFormatError, UnsafePickleError
from .sources.atlas.meta import CompressionStrategy
from .wids_in_place import wids_in_place
from .sources.atlas.writer import AtlasWriter

__all__ = ["AtlasDataset", "AtlasFormatError", "AtlasWriter", "CompressionStrategy", "Shard", "UnsafePickleError",
           "wids_in_place"]
__version__ = "0.1.0"
