"""geotrain: train one model across heterogeneous computers joined over the internet."""

__version__ = "0.1.0"
