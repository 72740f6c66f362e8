"""ling-bench: TTFT, prefill/decode tok/s and MTP acceptance of a vLLM server on fixed-seed prompt sets, measured
by `vllm bench serve`; plus the full-size in-process probe (`fullsize`) and the GB10 byte projection (`projection`)."""
