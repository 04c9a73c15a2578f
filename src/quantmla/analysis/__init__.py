"""quantmla.analysis"""
