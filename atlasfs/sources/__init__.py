"""The formats atlasfs shows, one module (or package) each, beside each other."""
