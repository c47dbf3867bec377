"""deployments room (see docs/architecture.md)."""
