import sys

from fastmamba.serve.cli import main

if __name__ == "__main__":  # the engine process (spawn) imports this module under another name
    sys.exit(main())
