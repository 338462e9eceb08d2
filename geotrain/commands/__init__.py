"""The `geotrain` subcommands, each with its parser; geotrain.cli dispatches to them."""
