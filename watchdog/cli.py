"""ling-watchdog: run a vLLM serve command under supervision, check it, or summarise a run.

  ling-watchdog [options] -- vllm serve MODEL ...            preflight, then supervise
  ling-watchdog preflight [options] -- vllm serve MODEL ...  only the safety rules (exit 2 = refused)
  ling-watchdog status [--log-dir DIR] [--json]              summarise the latest run of events.jsonl

Exit codes: 0 stopped on purpose | 2 refused by preflight | 3 gave up relaunching | 4 memory guard |
5 vLLM error a relaunch repeats | 6 memory not released | 7 bad watchdog settings or no such command |
128+N stopped by signal N. 2, 5 and 7 need a fix, not a restart (serve/vllm-ling.service).
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import os
import re
import signal
import sys
import uuid

from ling_common import envs
from ling_watchdog import memory, preflight, procs
from ling_watchdog.config import DEFAULTS, Config, field_types, load_config
from ling_common.device import Device, detect
from ling_watchdog.events import EventLog, dirs_with_events, format_summary, read_events, summarise, summary_json
from ling_watchdog.serve_args import ServeArgs, mask_argv
from ling_watchdog.supervisor import ExitCode, Supervisor

MiB = 1 << 20
USAGE = ("ling-watchdog [preflight] [options] -- <serve command...>\n"
         "       ling-watchdog status [--log-dir DIR] [--json]")


def _help_texts() -> dict[str, str]:
    """The comment beside each key in defaults.yaml, reused as the flag's help."""
    pairs = re.findall(r"^(\w+):[^#\n]*#\s*(.*)$", DEFAULTS.read_text(), re.M)
    return {k: v.replace("%", "%%") for k, v in pairs}


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="ling-watchdog", usage=USAGE, description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", action="append", default=[], metavar="FILE",
                   help="YAML settings over defaults.yaml (repeatable; later files win)")
    helps = _help_texts()
    for name, kind in field_types().items():
        flag = "--" + name.replace("_", "-")
        if kind is bool:
            p.add_argument(flag, dest=name, action=argparse.BooleanOptionalAction, default=None, help=helps.get(name))
        else:
            p.add_argument(flag, dest=name, type=kind, default=None, metavar=kind.__name__.upper(),
                           help=helps.get(name))
    return p


def _split(argv: list[str]) -> tuple[list[str], list[str]]:
    if "--" not in argv:
        return argv, []
    i = argv.index("--")
    return argv[:i], argv[i + 1:]


def _load(opts: argparse.Namespace) -> Config:
    overrides = {k: v for k, v in vars(opts).items() if k != "config"}
    env_file = envs.LING_WATCHDOG_CONFIG
    return load_config([*([str(env_file)] if env_file else []), *opts.config], overrides)


def device(cfg: Config) -> Device:
    """The GPU the rules judge (ling_common.device.detect), its memory model as configured unless auto."""
    dev = detect()
    return dev if cfg.memory_model == "auto" else dataclasses.replace(dev, kind=cfg.memory_model)


def break_even_for(cfg: Config, dev: Device, log: EventLog) -> Config:
    """The traffic line's break-even warning (spec_break_even) holds where decode is bound by the bytes it reads,
    as the projection it comes from assumes: a unified-memory GPU, a Spark. Elsewhere (a discrete GPU's plain step
    is bound by latency, so speculation pays below the projected length) it is dropped, with a note."""
    if cfg.spec_break_even is None or dev.kind == "unified":
        return cfg
    log.emit("spec_break_even_off", f"spec_break_even {cfg.spec_break_even:g} not applied: projected for a GPU "
             f"bound by its memory bandwidth (a Spark), and this one is {dev.kind}", quiet=True)
    return dataclasses.replace(cfg, spec_break_even=None)


def run_preflight(args: ServeArgs, cfg: Config, log: EventLog, dev: Device) -> bool:
    """Log every rule's verdict; True when the command may start."""
    host = preflight.Host(memory.available(), memory.total())
    if args.minimal:
        log.emit("serve_args", f"serve flags read by the watchdog's minimal parser, not vLLM's: "
                 f"{args.parser.removeprefix('minimal (').removesuffix(')')}; only the flags its rules need are "
                 f"read, the others pass through unchecked", level="warning", parser=args.parser)
    else:
        log.emit("serve_args", f"serve flags read by {args.parser}'s own parser", quiet=True, parser=args.parser)
    verdicts = preflight.check(args, cfg, dev, host)
    level = {"ok": "info", "warn": "warning", "refuse": "error"}
    for v in verdicts:
        log.emit("preflight", v.message if v.verdict != "ok" else f"{v.rule}: {v.message}",
                 level=level[v.verdict], rule=v.rule, verdict=v.verdict, device=dev.kind, values=v.values)
    refused = [v for v in verdicts if v.verdict == "refuse"]
    if refused and cfg.force:
        rules = ", ".join(v.rule for v in refused)
        log.emit("preflight_forced", f"!!! FORCED: starting despite {len(refused)} refused safety rule(s) "
                 f"({rules}) because of --force. Each of these limits exists because such settings hung or "
                 f"crashed a DGX Spark: watch this server closely. !!!", level="warning",
                 rules=[v.rule for v in refused])
        return True
    return not refused


def command_run(argv: list[str], only_preflight: bool) -> int:
    parser = build_parser()
    opts_argv, cmd = _split(argv)
    opts = parser.parse_args(opts_argv)
    if not cmd:
        parser.error("no serve command: put it after '--', e.g. ling-watchdog -- vllm serve MODEL")
    cfg = _load(opts)
    log = EventLog(cfg.log_dir, int(cfg.log_max_mb * MiB), cfg.log_backups)
    args = ServeArgs.parse(cmd)
    log.secrets.add(args.secrets(os.environ))  # before anything is written
    shown, run = mask_argv(cmd), uuid.uuid4().hex[:8]
    try:
        log.emit("start", f"ling-watchdog pid {os.getpid()} (run {run}): {' '.join(shown)}", pid=os.getpid(),
                 run=run, cmd=shown, config=dataclasses.asdict(cfg))
        dev = device(cfg)
        if not run_preflight(args, cfg, log, dev):
            log.emit("final", f"exit {int(ExitCode.PREFLIGHT)}: refused by the preflight safety rules above "
                     f"(fix the flags, or pass --force to override)", level="error", code=int(ExitCode.PREFLIGHT))
            return ExitCode.PREFLIGHT
        if only_preflight:
            log.emit("final", "exit 0: preflight passed (nothing started)", code=0)
            return ExitCode.OK
        cfg = break_even_for(cfg, dev, log)
        sup = Supervisor(cmd, cfg, log, cfg.url or f"http://{args.host}:{args.port}", args.served_model,
                         api_key=args.api_key(os.environ), shown=shown, run=run,
                         head=(args.master_addr, args.master_port) if args.worker_node else None)
        procs.become_subreaper()
        for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
            signal.signal(sig, sup.request_stop)
        return sup.run()
    finally:
        log.close()


def command_status(argv: list[str]) -> int:
    p = argparse.ArgumentParser(prog="ling-watchdog status", description="Summarise a watchdog's event log.")
    p.add_argument("--log-dir", default=None, help="the watchdog's log_dir (default: from defaults.yaml)")
    p.add_argument("--json", action="store_true", help="print the summary as JSON")
    opts = p.parse_args(argv)
    log_dir = opts.log_dir or load_config().log_dir
    records = read_events(log_dir)
    if not records:
        found = dirs_with_events(log_dir)
        hint = "".join(f"\n  ling-watchdog status --log-dir {d}" for d in found)
        print(f"no events in {log_dir}" + (f"; these folders under it hold a watchdog's events:{hint}" if found
              else " (the watchdog's --log-dir; the recipe's LOG_DIR, the demo's logs/demo)"), file=sys.stderr)
        return 1
    summary = summarise(records)
    print(json.dumps(summary_json(summary), indent=2) if opts.json else format_summary(summary))
    return 0


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    try:
        if argv[:1] == ["status"]:
            return command_status(argv[1:])
        if argv[:1] == ["preflight"]:
            return command_run(argv[1:], only_preflight=True)
        return command_run(argv, only_preflight=False)
    except ValueError as e:  # ConfigError, or a serve flag that is not a number (--port x)
        print(f"ling-watchdog: {e}", file=sys.stderr)
        return ExitCode.USAGE
