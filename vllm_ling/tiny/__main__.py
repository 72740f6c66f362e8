"""`python -m vllm_ling.tiny`: the same as `ling-make-tiny`."""
import sys

from vllm_ling.tiny.cli import main

sys.exit(main())
