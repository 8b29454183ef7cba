"""Layers: feature maps, positions, decays, short convolutions, norms, the decoding caches, the
operator-family records (families/), the attention base with its one forward and every kind, blocks."""
