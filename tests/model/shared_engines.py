"""Engines that several test modules share: one engine_runner.py process per engine configuration.

Starting a CPU engine (importing vLLM, building the model, sizing the caches) costs more than most tests' requests
on it, and several modules ask engines of one configuration for different things (test_mtp_engine.py and
test_draft_vocab_engine.py both need the `mtp_echo` checkpoint with MTP on). Each module declares its requests at
import, `declare(ENGINE, name, ...)`; the first test that needs a result of an engine starts that engine once, with
every request declared for it by then, and the `shared_engine` fixture (conftest.py) hands each test its own.

Each request is its own `generate` call on the engine (engine_runner.py `jobs`): its batch is scheduled as a fresh
engine of that configuration would schedule it, its spec-decode counters count its drafts alone, and its log lines
are the engine's start-up lines and its own. Prefix caching stays off on every shared engine, so no request can
reuse another's cache. Requests with equal contents are run once; a request declared after its engine ran starts
the engine again (slower, never wrong).
"""

from __future__ import annotations

import copy
import json
from dataclasses import dataclass, field
from pathlib import Path

from engine_runner import REQUEST_KEYS
from model_helpers import CPU_ENGINE_ENV, NO_CLAMPS, run_script


@dataclass(frozen=True)
class Engine:
    """One engine configuration: a tiny checkpoint (ling_tools.tiny.ensure_tiny's arguments), engine_runner.py's
    engine settings and the environment added to CPU_ENGINE_ENV."""

    name: str
    tiny: dict = field(default_factory=dict)
    settings: dict = field(default_factory=dict)
    env: dict = field(default_factory=dict)

    def spec(self) -> dict:
        """engine_runner.py's engine part of a spec, the checkpoint built (or found in its cache) now."""
        from ling_tools.tiny import ensure_tiny

        return {"model": str(ensure_tiny(**self.tiny)), **self.settings}


@dataclass(frozen=True)
class Request:
    engine: Engine
    name: str


# The settings that the whole-model tests' chunked-prefill engines share (test_engine_vs_oracle.py, test_tp.py,
# test_int4_engine.py, test_moe_reference.py): a 64-token budget, so that every prompt over 64 tokens is prefilled
# in chunks (KDA state carried across them), and seven sequences at once.
CHUNKED = {"max_num_batched_tokens": 64, "max_num_seqs": 7}
BF16 = Engine("bf16", settings={**CHUNKED, "hf_overrides": NO_CLAMPS})
BF16_CLAMPED = Engine("bf16-clamped", settings=CHUNKED)  # the checkpoint's own SwiGLU clamps on
INT4 = Engine("int4", tiny={"int4": True}, settings={**CHUNKED, "hf_overrides": NO_CLAMPS})

# The MTP tests' engines: fp32, a budget of 32 tokens (a 64-token prompt is prefilled in chunks before the first
# draft), without and with MTP k = 1.
MTP = {"method": "mtp", "num_speculative_tokens": 1}
MTP_SETTINGS = {"max_model_len": 512, "max_num_batched_tokens": 32, "hf_overrides": NO_CLAMPS}


def mtp_engines(variant: str) -> tuple[Engine, Engine]:
    """The plain and the MTP engine on a tiny checkpoint variant, in MTP_SETTINGS."""
    return (Engine(variant, tiny={"variant": variant}, settings=MTP_SETTINGS),
            Engine(f"{variant}-mtp", tiny={"variant": variant}, settings={**MTP_SETTINGS, "speculative_config": MTP}))


ECHO, ECHO_MTP = mtp_engines("mtp_echo")  # the draft built to agree with the target

_declared: dict[str, dict[str, dict]] = {}  # engine name -> request name -> request
_engines: dict[str, Engine] = {}


def declare(engine: Engine, name: str, **job) -> Request:
    """Declare a request (engine_runner.py's REQUEST_KEYS) on `engine`, at a test module's import."""
    unknown = set(job) - set(REQUEST_KEYS)
    assert not unknown, f"{name}: {sorted(unknown)} configure an engine, not a request: declare another Engine"
    known = _engines.setdefault(engine.name, engine)
    assert known == engine, f"two engines are called {engine.name!r}"
    jobs = _declared.setdefault(engine.name, {})
    assert jobs.get(name, job) == job, f"{engine.name}: two different requests are called {name!r}"
    jobs[name] = job
    return Request(engine, name)


class SharedEngines:
    """Runs each declared engine once, on first use, and keeps its requests' results for the session."""

    def __init__(self, tmp: Path) -> None:
        self.tmp = tmp
        self.results: dict[str, dict[str, dict]] = {}
        self.starts: dict[str, int] = {}

    def result(self, req: Request) -> dict:
        """`req`'s result (engine_runner.py's one-request form), a copy the test may change."""
        done = self.results.setdefault(req.engine.name, {})
        if req.name not in done:
            done.update(self._start(req.engine, {n: j for n, j in _declared[req.engine.name].items()
                                                 if n not in done}))
        return copy.deepcopy(done[req.name])

    def _start(self, engine: Engine, jobs: dict[str, dict]) -> dict[str, dict]:
        """One engine process for `jobs`, requests with equal contents run once."""
        unique: dict[str, dict] = {}
        alias = {name: unique.setdefault(json.dumps(job, sort_keys=True), name) for name, job in jobs.items()}
        n = self.starts[engine.name] = self.starts.get(engine.name, 0) + 1
        run = {first: self._paths(jobs[first], f"{engine.name}-{n}-{first}") for first in unique.values()}
        spec = {**engine.spec(), "jobs": run}
        out = run_script("engine_runner.py", spec, self.tmp, f"{engine.name}-{n}", {**CPU_ENGINE_ENV, **engine.env})
        return {name: out["jobs"][first] for name, first in alias.items()}

    def _paths(self, job: dict, stem: str) -> dict:
        """A request's output files (`capture_path`, declared as a bare name) placed in this session's folder."""
        if "capture_path" not in job:
            return job
        return {**job, "capture_path": str(self.tmp / f"{stem}-{job['capture_path']}")}
