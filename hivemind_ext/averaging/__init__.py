"""averaging layer (see DESIGN.md)."""
