"""Flows: composition of the stages only (Prefect)."""
