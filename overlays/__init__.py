"""overlays room (see docs/architecture.md)."""
