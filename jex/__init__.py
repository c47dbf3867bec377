"""jex: reproducible LLM benchmark campaigns.

The `jex` package holds what every room shares: settings, provenance, the suite format, atomic
file I/O and the command line. The rooms themselves are the top-level packages `engine`, `tasks`,
`overlays`, `flows`, `infra` and `deployments` (see docs/architecture.md).
"""

__version__ = "0.1.0"
