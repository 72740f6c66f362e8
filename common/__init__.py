"""ling_common: torch-free helpers the tools share (the watchdog, the tuner, the benchmarks, ling_tools): the
metrics scrape, the reading of vLLM's log, the GPU query, the shared-memory table, the tools' environment
variables. It imports neither the plugin nor a tool, so every one of them may import it."""
