"""A sharded PS: shard 0's view of its followers, and the followers themselves."""
