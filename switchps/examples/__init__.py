"""switchps.examples"""
