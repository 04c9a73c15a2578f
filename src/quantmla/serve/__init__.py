"""quantmla.serve"""
