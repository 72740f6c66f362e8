"""ling-bench: TTFT, prefill/decode tok/s and spec acceptance against OpenAI-compatible (vLLM) servers."""
