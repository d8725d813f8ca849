"""switchps: a parameter server with live-switchable synchronization."""

__version__ = "0.2.0"

EXIT_CONFIG = 2
"""A bad config or command line (one line per problem on stderr)."""
EXIT_INTERRUPTED = 130
"""Ctrl-C."""
