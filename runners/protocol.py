"""Temporary: the old path of runners.contract.tokens, until kestrel_one imports the new one."""

from runners.contract.tokens import *  # noqa: F403
