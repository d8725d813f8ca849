"""switchps: a parameter server with live-switchable synchronization."""

__version__ = "0.2.0"
