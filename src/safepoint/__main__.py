"""`python -m safepoint` runs the `safepoint` command."""

from safepoint.cli import main

raise SystemExit(main())
