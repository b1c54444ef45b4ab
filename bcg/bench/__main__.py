"""``python -m bcg.bench``: same as the ``bcg-bench`` console script."""

from bcg.bench.cli import main

raise SystemExit(main())
