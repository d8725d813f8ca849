"""Errors that the command line reports in one line, without a traceback."""


class RunDirError(RuntimeError):
    """A run directory that cannot be started or resumed."""


class PSUnreachable(RuntimeError):
    """The PS did not answer within ``cluster.reconnect_s``."""
