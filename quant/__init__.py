"""edgemoe.quant"""
