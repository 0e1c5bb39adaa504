"""``python -m dflash2.fast`` is the ``ft`` command."""

from .cli import main

raise SystemExit(main())
