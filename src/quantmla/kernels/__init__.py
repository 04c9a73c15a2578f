"""quantmla.kernels"""
