"""quant package."""
