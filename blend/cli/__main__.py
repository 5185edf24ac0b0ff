"""`python -m blend.cli ...` runs the `kvblend` command."""

from blend.cli import main

raise SystemExit(main())
