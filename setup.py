"""Builds geotrain's C extensions, geotrain.compression._blockquant, geotrain.protocol._streamio and
geotrain.node._gradsums; the rest of the metadata is in pyproject.toml.

All are optional: where they cannot be built (no C compiler), installation goes on, the int8 codec runs on torch
ops, writing the same bytes, slower, a received tensor's finiteness check is torch's sum, a raw tensor stream's
sockets are read and written by python's socket methods, and a stage's float64 gradient sums are torch's adds,
the same bits in more passes over memory.
"""

from setuptools import Extension, setup
from setuptools.command.build_ext import build_ext

# The kernel must compute exactly what the torch path does: no fused multiply-add (it rounds once where torch rounds
# twice) and no reassociation (fast-math would cancel the rounding constant).
UNIX_FLAGS = ["-O3", "-ffp-contract=off", "-fno-math-errno", "-fno-trapping-math"]
MSVC_FLAGS = ["/O2", "/fp:precise"]


class BuildExt(build_ext):
    """Picks the optimisation flags by the compiler that builds the extension."""

    def build_extensions(self) -> None:
        flags = MSVC_FLAGS if self.compiler.compiler_type == "msvc" else UNIX_FLAGS
        for ext in self.extensions:
            ext.extra_compile_args = flags
        super().build_extensions()


setup(
    ext_modules=[
        Extension("geotrain.compression._blockquant", ["geotrain/compression/_blockquant.c"], optional=True),
        Extension("geotrain.protocol._streamio", ["geotrain/protocol/_streamio.c"], optional=True),
        Extension("geotrain.node._gradsums", ["geotrain/node/_gradsums.c"], optional=True),
    ],
    cmdclass={"build_ext": BuildExt},
)
