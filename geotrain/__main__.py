"""`python -m geotrain`."""

from geotrain.cli import run

run()
