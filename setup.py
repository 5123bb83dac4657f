"""The one compiled piece: the inner loops of plan evaluation (roundpipe/plan/_kernels.c).

Optional: without a C compiler the install goes on, and planning runs the same loops in Python
(roundpipe/plan/native.py). Everything else about the package is in pyproject.toml.
"""

from setuptools import Extension, setup

setup(
    ext_modules=[
        Extension(
            "roundpipe.plan._kernels",
            ["roundpipe/plan/_kernels.c"],
            # no fused multiply-adds: each float operation rounds as Python's does
            extra_compile_args=["-O2", "-ffp-contract=off"],
            optional=True,
        )
    ]
)
