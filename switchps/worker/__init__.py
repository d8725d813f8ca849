"""switchps.worker"""
