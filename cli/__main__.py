"""``python -m dflash2.cli`` is the ``ft`` command."""

from .main import main

raise SystemExit(main())
