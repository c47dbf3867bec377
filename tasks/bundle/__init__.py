"""The bundle: the one reader of the suite as data. `bundle_file` streams a suite into a byte-reproducible
tar.gz of Parquet shards and opens one; `suite_table` is what scoring reads of it (the scored rows, the
`ScoreSpec`) and a predictions file checked against it."""
