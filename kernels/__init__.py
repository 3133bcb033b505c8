"""edgemoe.kernels"""
