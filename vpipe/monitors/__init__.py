"""monitors"""
