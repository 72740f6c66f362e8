"""ling-tune's engine race on the GPU: each backend asked for is the one vLLM serves, and each is timed at every M.

Needs CUDA and vLLM >= 0.28 (the releases that honour --moe-backend for compressed-tensors INT4 experts).
Two engines of a 2-layer model (~2 min each on the H200). Run: bash tests/gpu/run_on_device.sh engine_race
"""

from __future__ import annotations

from pathlib import Path

import pytest
from gpu_helpers import record  # importing gpu_helpers skips the module without CUDA

from ling_tuning.engine_compare import compare_engines, report  # noqa: E402
from ling_tuning.shapes import bundled_config_path  # noqa: E402

MS = [1, 8, 64]


@pytest.fixture(scope="module")
def race(tmp_path_factory):
    work = tmp_path_factory.mktemp("race")
    results = compare_engines(bundled_config_path(), ["marlin", "humming"], MS, work, layers=2, timeout=400)
    record("engine_race", report(results, MS, 2))
    return results, Path(work)


def test_each_backend_asked_for_is_the_one_vllm_serves(race):
    results, work = race
    for r in results:
        assert r.error is None, (r.backend, r.error, (work / f"engine-{r.backend}.log").read_text()[-3000:])
        assert r.served == r.backend


def test_each_backend_is_timed_at_every_batch_size(race):
    results, _ = race
    for r in results:
        assert sorted(r.step_us) == MS and all(us > 0 for us in r.step_us.values()), r
