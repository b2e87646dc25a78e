"""`python -m triattn_cupy`: the same as the `triattn-infer` command."""
import sys

from .cli.main import main

if __name__ == "__main__":
    sys.exit(main(prog="python -m triattn_cupy"))
