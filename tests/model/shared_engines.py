"""Engines that several test modules share: one engine_runner.py process per engine configuration.

Starting a CPU engine (importing vLLM, building the model, sizing the caches) costs more than most tests' requests
on it, and several modules ask engines of one configuration for different things (test_mtp_engine.py and
test_draft_vocab_engine.py both need the `mtp_echo` checkpoint with MTP on). Each module declares its requests at
import, `declare(ENGINE, name, ...)`; the first test that needs a result of an engine starts that engine once, with
every request declared for it by then, and the `shared_engine` fixture (conftest.py) hands each test its own. The
engines a module declared requests on start together, two at a time (one per core).

Each request is its own `generate` call on the engine (engine_runner.py `jobs`): its batch is scheduled as a fresh
engine of that configuration would schedule it, its spec-decode counters count its drafts alone, and its log lines
are the engine's start-up lines and its own. Prefix caching stays off on every shared engine, so no request can
reuse another's cache. Requests with equal contents are run once; a request declared after its engine ran starts
the engine again (slower, never wrong).
"""

from __future__ import annotations

import copy
import json
import os
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

from engine_runner import REQUEST_KEYS
from model_helpers import CPU_ENGINE_ENV, HERE, NO_CLAMPS, TIMEOUT_S


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
    """A declared request: its engine and its name there (several names may share one set of contents)."""

    engine: Engine
    name: str
    module: str  # the declaring test module: its engines start together


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
_modules: dict[str, list[str]] = {}  # test module -> the engines it declared requests on, in order
PARALLEL = 2  # engines started at once: one OpenMP thread each (tests/conftest.py), one per core


def declare(engine: Engine, name: str, **job) -> Request:
    """Declare a request (engine_runner.py's REQUEST_KEYS) on `engine`, at a test module's import."""
    unknown = set(job) - set(REQUEST_KEYS)
    assert not unknown, f"{name}: {sorted(unknown)} configure an engine, not a request: declare another Engine"
    assert not engine.settings.get("prefix_caching"), f"{engine.name}: a shared engine keeps prefix caching off"
    known = _engines.setdefault(engine.name, engine)
    assert known == engine, f"two engines are called {engine.name!r}"
    jobs = _declared.setdefault(engine.name, {})
    assert jobs.get(name, job) == job, f"{engine.name}: two different requests are called {name!r}"
    jobs[name] = job
    module = sys._getframe(1).f_globals["__name__"]
    if engine.name not in _modules.setdefault(module, []):
        _modules[module].append(engine.name)
    return Request(engine, name, module)


class SharedEngines:
    """Runs each declared engine once, on first use, and keeps its requests' results for the session.

    A test module's first request starts every engine that module declared requests on and that has not run yet,
    PARALLEL at a time (the engines of one module are independent processes; nothing else runs meanwhile: the
    session waits in that module's fixture). An engine that fails fails the tests that ask for its results, with
    its log, and no other."""

    def __init__(self, tmp: Path) -> None:
        self.tmp = tmp
        self.results: dict[str, dict[str, dict]] = {}
        self.errors: dict[str, str] = {}
        self.starts: dict[str, int] = {}

    def result(self, req: Request) -> dict:
        """`req`'s result (engine_runner.py's one-request form), a copy the test may change."""
        name = req.engine.name
        if name not in self.results and name not in self.errors:
            waiting = [e for e in _modules[req.module] if e not in self.results and e not in self.errors]
            self._run([name] + [e for e in waiting if e != name])
        elif name in self.results and req.name not in self.results[name]:  # declared after its engine ran
            self._run([name])
        if name in self.errors:
            raise AssertionError(self.errors[name])
        return copy.deepcopy(self.results[name][req.name])

    def _run(self, names: list[str]) -> None:
        """Each named engine in a process of its own for its requests that have no result yet, PARALLEL at a time;
        every process is waited for or killed before this returns."""
        pending, running = list(names), []
        try:
            while pending or running:
                while pending and len(running) < PARALLEL:
                    running.append(self._launch(pending.pop(0)))
                for run in [r for r in running if r.proc.poll() is not None or r.overdue()]:
                    running.remove(run)
                    self._collect(run)
                time.sleep(0.2)
        finally:
            for run in running:
                run.kill()

    def _launch(self, name: str) -> _Run:
        """Start engine `name` on its requests that have no result yet; requests with equal contents run once."""
        engine, done = _engines[name], self.results.get(name, {})
        jobs = {n: j for n, j in _declared[name].items() if n not in done}
        unique: dict[str, str] = {}
        alias = {n: unique.setdefault(json.dumps(j, sort_keys=True), n) for n, j in jobs.items()}
        n = self.starts[name] = self.starts.get(name, 0) + 1
        stem = f"{name}-{n}"
        run = {first: self._paths(jobs[first], f"{stem}-{first}") for first in unique.values()}
        spec = {**engine.spec(), "jobs": run}
        return _Run.start(name, stem, spec, self.tmp, {**CPU_ENGINE_ENV, **engine.env}, alias)

    def _collect(self, run: _Run) -> None:
        """A finished (or overdue) engine's results, or the error its tests will report."""
        try:
            out = run.output()
        except AssertionError as err:
            self.errors[run.name] = str(err)
            return
        self.results.setdefault(run.name, {}).update({n: out["jobs"][first] for n, first in run.alias.items()})

    def _paths(self, job: dict, stem: str) -> dict:
        """A request's output files (`capture_path`, declared as a bare name) placed in this pytest session's folder."""
        if "capture_path" not in job:
            return job
        return {**job, "capture_path": str(self.tmp / f"{stem}-{job['capture_path']}")}


@dataclass
class _Run:
    """One engine_runner.py process of a shared engine."""

    name: str
    proc: subprocess.Popen
    log: Path
    out: Path
    alias: dict[str, str]  # request name -> the name its contents run under
    deadline: float

    @classmethod
    def start(cls, name: str, stem: str, spec: dict, tmp: Path, env: dict, alias: dict[str, str]) -> _Run:
        spec_path, out, log = tmp / f"{stem}.spec.json", tmp / f"{stem}.out.json", tmp / f"{stem}.log"
        spec_path.write_text(json.dumps(spec))
        with open(log, "w") as f:
            proc = subprocess.Popen([sys.executable, str(HERE / "engine_runner.py"), str(spec_path), str(out)],
                                    env={**os.environ, **env}, stdout=f, stderr=subprocess.STDOUT)
        return cls(name, proc, log, out, alias, time.monotonic() + TIMEOUT_S)

    def overdue(self) -> bool:
        return time.monotonic() > self.deadline

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait()

    def output(self) -> dict:
        """The process's result; an AssertionError with its log's tail if it failed or ran past TIMEOUT_S."""
        late = self.proc.poll() is None
        self.kill()
        if self.proc.returncode != 0:
            why = f"ran past {TIMEOUT_S} s" if late else f"failed ({self.proc.returncode})"
            raise AssertionError(f"engine {self.name} {why}:\n{self.log.read_text()[-12000:]}")
        return json.loads(self.out.read_text())
