"""Suite-wide settings that every process the tests start inherits (engines, the oracle, the demo's server).

One OpenMP thread per process, unless the caller set OMP_NUM_THREADS. The tiny checkpoints' ops are far too small
for intra-op threads to pay, and on a 2-core host a second thread spin-waits for the first whenever another process
holds a core: vLLM's CPU worker keeps torch's threads at the core count (it disables `torch.set_num_threads` after
binding, so its own "reducing to 1 thread" step is skipped), and `index_add_` in the torch MoE then takes ms
instead of µs. Measured on the 2-core CI box with another process busy: one engine_runner.py run of
test_engine_vs_oracle.py's batch 281 s with two threads, 46 s with one (outputs equal, logprobs within 1e-5); the
oracle scoring that batch 24 s and 11 s. Set here, before any test module imports torch, so the pytest process
itself starts with one thread too (as tests/model/conftest.py's `single_thread` already asks of its modules).
"""

from __future__ import annotations

import os

os.environ.setdefault("OMP_NUM_THREADS", "1")
