"""edgemoe.store"""
