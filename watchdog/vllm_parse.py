"""Parse serve arguments with the installed vLLM's own parser; print what it set as one JSON line.

    python vllm_parse.py '["/models/ling", "--max-model-len", "128k", "--async-scheduling"]'

The parser is `make_arg_parser(FlexibleArgumentParser())`, the one `vllm serve` and the API server module
build, followed by vLLM's quick `validate_parsed_serve_args` checks: every flag of that release, with its
spellings (`--max_model_len`, `-sc`, `--speculative-config.num_speculative_tokens 2`, `--config FILE`).
It imports no ling_watchdog module, so that any interpreter with vLLM can run it as a plain script. The
watchdog runs it in a subprocess: importing vLLM takes ~10 s, ~650 MB (torch) and rewrites os.environ
(vllm/env_override.py), none of which belongs in a supervisor that lives as long as the server
(docs/ops-walls.md, "The watchdog's own footprint").

Prints `RESULT_TAG {"vllm": version, "values": {dest: value}, "given": [dest, ...]}`, or
`RESULT_TAG {"error": "<vLLM's message>"}` when vLLM refuses the arguments (vLLM would exit 2 on them).
"""
from __future__ import annotations

import contextlib
import importlib
import io
import json
import sys
from typing import Any

RESULT_TAG = "ling-watchdog vllm-parse:"
# Where make_arg_parser lives: older releases, then (0.32-0.34) vllm.entrypoints.common.cli_args.
MODULES = ("vllm.entrypoints.openai.cli_args", "vllm.entrypoints.launchers.cli_args",
           "vllm.entrypoints.common.cli_args")


def _module():
    for name in MODULES:
        try:
            return importlib.import_module(name)
        except ModuleNotFoundError as e:
            if not (e.name or "").startswith("vllm.entrypoints"):
                raise  # vLLM itself (or a dependency) is missing, not this module path
    raise ModuleNotFoundError(f"this vLLM has none of {MODULES}")


def parser_and_validator():
    """vLLM's serve parser and its post-parse check (None where the release has none)."""
    module = _module()
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    return module.make_arg_parser(FlexibleArgumentParser(prog="vllm serve")), getattr(
        module, "validate_parsed_serve_args", None)


_cached = None


def parse(args: list[str]) -> dict[str, Any]:
    """vLLM's namespace for `args` (JSON-safe), the dests they set, or vLLM's refusal."""
    global _cached
    if _cached is None:
        parser, validate = parser_and_validator()
        _cached = parser, validate, vars(parser.parse_args([]))
    parser, validate, defaults = _cached
    import vllm

    version = getattr(vllm, "__version__", "?")
    err = io.StringIO()
    try:
        with contextlib.redirect_stderr(err):
            ns = parser.parse_args(list(args))
            if validate is not None:
                validate(ns)
    except SystemExit:
        lines = [x for x in err.getvalue().splitlines() if x.strip()]
        message = (lines[-1] if lines else "vLLM's parser exited").removeprefix("vllm serve: error: ")
        return {"vllm": version, "error": message}
    except (TypeError, ValueError) as e:
        return {"vllm": version, "error": str(e).removeprefix("Error: ")}
    values = json.loads(json.dumps(vars(ns), default=str))
    given = sorted(k for k, v in vars(ns).items() if k not in defaults or defaults[k] != v)
    return {"vllm": version, "values": values, "given": given}


def main(argv: list[str]) -> int:
    print(RESULT_TAG, json.dumps(parse(json.loads(argv[0]))), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
