"""numpy, imported at its first use. The SDK's packing code needs it; the CLI's commands that never pack
records (status, rate, config) imported it at every start, a tenth of a second of each."""

from __future__ import annotations

from typing import Any


class LazyNumpy:
    """Stands for numpy in a module's namespace; the first attribute taken imports numpy and puts it
    in that namespace in this object's place, so later uses cost nothing extra."""

    def __init__(self, namespace: dict[str, Any], name: str = "np") -> None:
        self._namespace = namespace
        self._name = name

    def __getattr__(self, attribute: str) -> Any:
        import numpy  # noqa: PLC0415

        self._namespace[self._name] = numpy
        return getattr(numpy, attribute)
