"""Campaign stages: pure functions over polars frames, with thin Prefect task wrappers beside them."""
