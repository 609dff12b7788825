"""``python -m fastmamba.bench <target> ...``; see ``fastmamba.bench.targets``."""
import sys

from fastmamba.bench.targets import main

if __name__ == "__main__":
    sys.exit(main())
