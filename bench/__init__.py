"""baton.bench"""
