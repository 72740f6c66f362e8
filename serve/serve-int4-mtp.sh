#!/usr/bin/env bash
# The shipped recipe: Ling-3.0-flash INT4 + MTP k=1 + CUDA graphs, util 0.72, chunked prefill 8192,
# under ling-watchdog. MTP k=1 took decode from 22.9 to 40.9 tok/s (W3); k>1 is refused on GB10.
# Settings: see serve-int4.sh (all environment variables; MTP_K=1 here).
set -euo pipefail
MTP_K=${MTP_K:-1} exec bash "$(dirname "${BASH_SOURCE[0]}")/serve-int4.sh" "$@"
