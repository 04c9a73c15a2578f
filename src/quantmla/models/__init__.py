"""quantmla.models"""
