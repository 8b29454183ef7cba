"""Layers: feature maps, positions, decays, short convolutions, attention layers of every kind, blocks."""
