"""baton.engine.models"""
