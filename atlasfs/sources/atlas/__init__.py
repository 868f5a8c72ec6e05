"""Atlas datasets: the format's metadata, block codec, reader and writer."""
