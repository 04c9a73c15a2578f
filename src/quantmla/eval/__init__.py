"""quantmla.eval"""
