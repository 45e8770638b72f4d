"""``python -m scheduler.cli`` — the same as the ``duetime`` command."""

from scheduler.cli import main

raise SystemExit(main())
