"""switchps.configs"""
