"""Wiring only: Ray actors, the driver loop, its cadence, and the Ray bootstrap (``docs/architecture.md``).

``from tba.runtime import RayRuntime`` imports Ray; :mod:`tba.runtime.cadence` and
:mod:`tba.runtime.state` do not, so the run policy is testable without it.
"""


def __getattr__(name: str):
    if name in ("RayRuntime", "mode_config"):
        from tba.runtime import driver

        return getattr(driver, name)
    raise AttributeError(f"module 'tba.runtime' has no attribute {name!r}")
