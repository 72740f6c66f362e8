"""ling-watchdog: supervise `vllm serve` for Ling-3.0-flash on a DGX Spark.

Imported as `ling_watchdog` (the folder is watchdog/) so it never shadows PyPI's `watchdog`.
"""
