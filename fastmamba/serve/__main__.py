import sys

from fastmamba.serve.cli import main

sys.exit(main())
