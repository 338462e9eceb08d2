"""`python -m geotrain`."""

import sys

from geotrain.cli import main

sys.exit(main())
