"""ling_tools: maintenance commands outside the served plugin (`python -m ling_tools.seams`: does a vLLM release,
installed, on PyPI or in a source folder, still have what vllm-ling needs)."""
