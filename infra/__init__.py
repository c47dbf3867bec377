"""infra room (see docs/architecture.md)."""
