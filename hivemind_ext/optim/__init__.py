"""optim layer (see DESIGN.md)."""
