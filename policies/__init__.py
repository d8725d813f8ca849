"""switchps.policies"""
