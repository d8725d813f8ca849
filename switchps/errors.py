"""Errors that the command line reports in one line, without a traceback."""


class RunDirError(RuntimeError):
    """A run directory that cannot be started or resumed."""


class PSUnreachable(RuntimeError):
    """The PS did not answer within ``cluster.reconnect_s``."""


class ShardLost(RuntimeError):
    """A shard of a sharded PS left the run (or shard 0 did, for a follower): no push can complete. The
    process exits with ``EXIT_SHARD_LOST``, and `switchps run` restarts every shard from the checkpoint."""


EXIT_SHARD_LOST = 75
"""EX_TEMPFAIL: try again (a PS shard whose run can be resumed)."""
