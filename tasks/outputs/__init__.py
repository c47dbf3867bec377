"""A run's products: the report, the per-sample records, exports to and imports from other tools."""
