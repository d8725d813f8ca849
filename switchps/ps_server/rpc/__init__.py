"""The gRPC driver of the protocol core: the service, its server, its guard and its entry point."""
