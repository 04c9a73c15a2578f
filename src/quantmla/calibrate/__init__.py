"""quantmla.calibrate"""
