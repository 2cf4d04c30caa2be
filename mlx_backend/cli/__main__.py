import sys

from mlx_backend.cli import main

sys.exit(main())
