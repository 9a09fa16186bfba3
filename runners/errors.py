"""Temporary: the old path of runners.contract.errors, until kestrel_one imports the new one."""

from runners.contract.errors import *  # noqa: F403
