"""p2p layer (see DESIGN.md)."""
