"""`python -m cp_softcap`: the kernel-selection CLI (cp_softcap/cli.py)."""
import sys

from .cli import main

sys.exit(main())
