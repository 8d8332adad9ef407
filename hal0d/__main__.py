import sys

import hal0d

if getattr(hal0d, "__file__", None) is None:
    # A folder named hal0d in the current directory (a clone's own, say) is taken for the
    # package: its name and nothing else, and then half of hal0d is missing.
    shadow = next(iter(getattr(hal0d, "__path__", [])), "hal0d")
    sys.exit(f"hal0d: the folder {shadow} shadows the installed hal0d in `python -m hal0d`; "
             "run it from another folder, or use the `hal0d` command")

from hal0d.cli import main  # after the check: it is the import that would fail

raise SystemExit(main())
