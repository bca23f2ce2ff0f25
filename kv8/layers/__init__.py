"""Building blocks a model file is made of: each layer picks its implementation when the model is loaded."""
