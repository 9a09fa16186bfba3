"""Temporary: the old path of runners.contract.registry, until kestrel_one imports the new one."""

from runners.contract.arguments import *  # noqa: F403
from runners.contract.errors import InvalidArguments, UnknownTool  # noqa: F401
from runners.contract.registry import *  # noqa: F403
