"""baton.kernels"""
