"""What is trained: the datasets, and each framework's models, gradients, scoring and model files."""
