"""`ling-make-tiny`: write a tiny checkpoint, build one into the cache, or write the full-size config."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from ling_tools.tiny.cache import CACHE_ENV, cache_root, ensure_tiny
from ling_tools.tiny.config import VARIANTS
from ling_tools.tiny.writer import dequantize_checkpoint, make_tiny_checkpoint, write_full_config


def parser() -> argparse.ArgumentParser:
    cache = str(cache_root() / "tiny-VARIANT-{bf16,int4}-seedN").replace("%", "%%")
    p = argparse.ArgumentParser(
        prog="ling-make-tiny",
        description="Write a tiny random-weight Ling-3.0 checkpoint (or the full-size Flash INT4 config).")
    p.add_argument("out", type=Path, nargs="?",
                   help=f"output directory (default: build once into the cache, {cache}; ${CACHE_ENV} "
                        "moves the cache)")
    p.add_argument("--seed", type=int, default=0, help="weight seed (same seed -> identical files)")
    p.add_argument("--int4", action="store_true", help="routed experts as compressed-tensors INT4")
    p.add_argument("--variant", choices=VARIANTS, default="default",
                   help="'qlora': MLA q_a_proj/q_b_proj (q_lora_rank 64) instead of q_proj; 'mtp_echo': a draft "
                        "that agrees with the model; 'stable_router': expert choice robust to bf16 noise")
    p.add_argument("--force", action="store_true", help="overwrite a non-empty output directory")
    mode = p.add_mutually_exclusive_group()
    mode.add_argument("--full-config", action="store_true",
                      help="write the full-size Ling-3.0-flash-int4 config.json + generation_config.json "
                           "(no weights: use vLLM's --load-format dummy --skip-tokenizer-init)")
    p.add_argument("--tokenizer", action="store_true",
                   help="with --full-config: the tiny tokenizer and chat template beside it, so a full-size "
                        "--load-format dummy server takes text (for load benchmarks: the text means nothing; ids "
                        "past the tokenizer's ~1000 decode to nothing)")
    mode.add_argument("--dequantize", type=Path, metavar="INT4_DIR",
                      help="write INT4_DIR's checkpoint dequantized to BF16 into OUT")
    mode.add_argument("--dspark", type=Path, metavar="TARGET_DIR",
                      help="write a tiny DSpark drafter for the tiny target in TARGET_DIR into OUT (random; with "
                           "--dspark-agree one that drafts what an mtp_echo target says; docs/dspark.md)")
    p.add_argument("--dspark-agree", action="store_true", help="with --dspark: the agreeing drafter")
    return p


def main(argv: list[str] | None = None) -> int:
    p = parser()
    args = p.parse_args(argv)
    if args.out is None and (args.full_config or args.dequantize or args.dspark):
        p.error("--full-config, --dequantize and --dspark need an output directory")
    if args.dspark_agree and not args.dspark:
        p.error("--dspark-agree goes with --dspark TARGET_DIR")
    if args.tokenizer and not args.full_config:
        p.error("--tokenizer goes with --full-config (every tiny checkpoint already has its tokenizer)")
    try:
        if args.out is None:
            path = ensure_tiny(seed=args.seed, int4=args.int4, variant=args.variant)
        elif args.full_config:
            path = write_full_config(args.out, force=args.force, tokenizer=args.tokenizer)
        elif args.dequantize:
            path = dequantize_checkpoint(args.dequantize, args.out)
        elif args.dspark:
            from ling_tools.tiny.dspark import make_tiny_dspark

            path = make_tiny_dspark(args.out, args.dspark, seed=args.seed, agree=args.dspark_agree, force=args.force)
        else:
            path = make_tiny_checkpoint(args.out, seed=args.seed, int4=args.int4, variant=args.variant,
                                        force=args.force)
    except (FileExistsError, ValueError) as err:
        print(f"ling-make-tiny: error: {err}", file=sys.stderr)
        return 2
    print(path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
