"""``python -m fastmamba.bench <target> ...``; see ``fastmamba.bench.targets``. A user error (a bad
model name or path, a bad option value, a missing package) is one line on stderr and exit status 2,
as with ``fastmamba bench``; FASTMAMBA_DEBUG=1 shows the traceback instead."""
import os
import sys

from fastmamba.bench.targets import main
from fastmamba.extras import USER_ERRORS, report_user_error

if __name__ == "__main__":
    try:
        sys.exit(main())
    except USER_ERRORS as exc:
        if os.environ.get("FASTMAMBA_DEBUG", "0") not in ("", "0"):
            raise
        sys.exit(report_user_error(exc, "python -m fastmamba.bench"))
