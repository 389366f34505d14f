"""Compatibility alias of sluice_client.errors (the client SDK's errors)."""

from sluice_client.errors import *  # noqa: F403
from sluice_client.errors import __all__  # noqa: F401 - re-exported with the names it lists
