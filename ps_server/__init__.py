"""switchps.ps_server"""
