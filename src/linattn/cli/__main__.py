"""`python -m linattn.cli`: the `linattn` command."""

from .app import main

raise SystemExit(main())
