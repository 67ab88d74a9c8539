"""`python -m tuner.cli`: the `tuner` command."""

from tuner.cli import main

raise SystemExit(main())
