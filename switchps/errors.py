"""Errors that the command line reports in one line, without a traceback."""


class RunDirError(RuntimeError):
    """A run directory that cannot be started or resumed."""


class PSUnreachable(RuntimeError):
    """The PS did not answer within ``cluster.reconnect_s``."""


class ShardLost(RuntimeError):
    """A shard of a sharded PS left the run (or shard 0 did, for a follower): no push can complete."""
