"""baton.grammar"""
