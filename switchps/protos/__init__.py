"""switchps.protos"""
