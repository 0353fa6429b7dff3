"""`python -m swiftkv_distill distill|eval ...`: the same as `swiftkv distill|eval ...`."""

import sys

from .cli import main

sys.exit(main(prog="python -m swiftkv_distill"))
