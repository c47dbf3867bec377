"""Scoring: the index, its two scorers, the clustered bootstrap CI and the reference audit."""
