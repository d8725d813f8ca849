"""Credentials: the run's tokens, TLS certificates and the channels built from them."""
