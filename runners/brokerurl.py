"""Temporary: the old path of runners.contract.broker, until kestrel_one imports the new one."""

from runners.contract.broker import *  # noqa: F403
