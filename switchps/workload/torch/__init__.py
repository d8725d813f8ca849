"""The PyTorch framework: its model zoo, flat parameters, gradient computer, scoring and model files."""
