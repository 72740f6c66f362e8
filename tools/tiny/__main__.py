"""`python -m ling_tools.tiny`: the same as `ling-make-tiny`."""
import sys

from ling_tools.tiny.cli import main

sys.exit(main())
