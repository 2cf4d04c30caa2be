"""``python -m conformance``: run the conformance suite against a backend (see ``--help``)."""
import sys

from conformance.cli import main

sys.exit(main())
